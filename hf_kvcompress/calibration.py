"""Bases of a model's keys and values, fitted on calibration text (for `lowrank`).

`calibrate_joint` (what `hf-kvcompress calibrate` writes and the package ships) fits one basis per layer and kind over
the layer's KV heads concatenated, keys before RoPE: on held-out text that loses less than half the variance that
per-head bases of post-RoPE keys lose at the same number of dimensions (docs/methods.md, the measurement behind the
choice). Keys are PCA; values PCA too by default, or fitted to the attention output after the output projection
(`value_fit`, `output_weighted_pca`). `calibrate` fits one PCA basis per KV head, keys after RoPE as the cache
receives them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .hf.compat import text_config
from .hf.rope import rope_inv_freq
from .ops.rerotate import rerotate

BASES_FILE = "lowrank_bases.safetensors"
PACKAGED_DIR = Path(__file__).parent / "calibrations"
FORMAT = "hf-kvcompress-lowrank-1"
JOINT = "joint"  # metadata `heads`: one basis over a layer's KV heads (keys pre-RoPE); absent: one per head
CALIBRATION_TEXT = "HotpotQA paragraphs (RULER data, CC BY-SA 4.0)"


def model_identity(config) -> str:
    """The name bases are tied to: a Hub id as given, a local directory (the embedded models') by its own name."""
    name = str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")
    if not name:
        raise ValueError("this model's config has no name_or_path, so calibrated bases cannot be tied to it")
    return Path(name).name if os.path.isdir(name) or os.path.isabs(name) else name


# A paragraph that holds a number of at least this many digits counts as number-bearing (`calibration_text`).
LONG_NUMBER = re.compile(r"\d{5,}")


def calibration_text(words: int = 4000, numbers: float = 0.0) -> str:
    """HotpotQA paragraphs (Wikipedia), the last of the sorted distinct paragraphs: none of the eval suite's
    haystacks (the needle tasks' essays, multi_question's novel); only doc_qa with source=hotpotqa reads them.

    `numbers`: the share of the words taken from number-bearing paragraphs (those holding a number of 5 or more
    digits, `LONG_NUMBER`; again the last ones first, none taken twice), placed among the others as they come
    due. 0 (the default) gives the plain last paragraphs."""
    from .eval.data import hotpotqa_questions  # the lab's data: loading bases (the library's path) never reads it

    if isinstance(numbers, bool) or not isinstance(numbers, (int, float)) or not 0 <= numbers <= 1:
        raise ValueError(f"numbers must be a share in [0, 1] (of the words from number-bearing paragraphs), "
                         f"got {numbers!r}")
    _, paragraphs = hotpotqa_questions()
    plain = iter(reversed(paragraphs))
    numbered = (p for p in reversed(paragraphs) if LONG_NUMBER.search(p))
    picked: list[str] = []
    taken: set[str] = set()
    count = from_numbered = 0
    while count < words:
        # The next paragraph is number-bearing while those hold less than their share of the words so far.
        source = numbered if numbers > 0 and from_numbered <= numbers * count else plain
        paragraph = next((p for p in source if p not in taken), None)
        if paragraph is None:
            break
        picked.append(paragraph)
        taken.add(paragraph)
        count += len(paragraph.split())
        if source is numbered:
            from_numbered += len(paragraph.split())
    return "\n\n".join(picked)


def pca(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """states [H, N, D] -> (mean [H, D], basis [H, D, D] columns by falling variance, variances [H, D])."""
    x = states.double()
    mean = x.mean(1)
    centered = x - mean[:, None]
    cov = centered.transpose(1, 2) @ centered / x.shape[1]
    variances, vectors = torch.linalg.eigh(cov)
    return mean.float(), vectors.flip(-1).float(), variances.flip(-1).clamp(min=0).float()


def explained(variances: torch.Tensor, rank: int) -> float:
    """Share of the total variance the first `rank` components keep, over all heads of a layer."""
    return float(variances[..., :rank].sum() / variances.sum())


@torch.inference_mode()
def layer_states(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [H, T, D] of every layer for one sequence, keys post-RoPE as a cache receives them."""
    cache = DynamicCache()  # no config: every layer keeps every token, sliding ones included
    model(input_ids=input_ids, cache=cache, use_cache=True)
    states = []
    for layer in cache.layers:
        # A DynamicCache without a config: DynamicLayers, each filled by the forward pass.
        assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
        states.append((layer.keys[0].float(), layer.values[0].float()))
    return states


def rope_frequencies(config) -> tuple[tuple[float, ...], ...]:
    """Each decoder layer's RoPE inverse frequencies (its layer type's), as numbers."""
    decoder = text_config(config)
    layer_types = getattr(decoder, "layer_types", None) or [None] * decoder.num_hidden_layers
    by_type = {kind: tuple(rope_inv_freq(config, kind).tolist()) for kind in set(layer_types)}
    return tuple(by_type[kind] for kind in layer_types)


def unrotated(keys: torch.Tensor, config, layer_idx: int) -> torch.Tensor:
    """Keys [H, T, D] with RoPE undone (position t rotated back by t): what pre-RoPE keys look like."""
    inv_freq = torch.tensor(rope_frequencies(config)[layer_idx])
    positions = torch.arange(keys.shape[1], dtype=torch.float32).expand(keys.shape[0], -1)
    return rerotate(keys[None], -positions[None], inv_freq)[0]


# The share of lowrank's calibration words from number-bearing paragraphs (`calibration_text`'s `numbers`), what
# `hf-kvcompress calibrate` fits the low-rank bases on unless told otherwise.
LOWRANK_NUMBERS = 0.0


def calibration_name(numbers: float) -> str:
    """The calibration text's name in a file's metadata (`text`), its share of number-bearing paragraphs with it."""
    if not numbers:
        return CALIBRATION_TEXT
    return f"{CALIBRATION_TEXT}, {numbers:g} of the words from paragraphs holding a number of 5+ digits"


def bases_numbers(metadata: dict[str, str]) -> float:
    """The share of number-bearing paragraphs in the text the bases were fitted on (0 for files written before the
    share existed): their error curves and copy weights are measured on the same text's held-out part."""
    return float(metadata.get("numbers", 0.0))


def calibration_ids(tokenizer, tokens: int = 2048, numbers: float = 0.0) -> torch.Tensor:
    """[1, tokens] ids of the calibration text (`numbers`: its share of number-bearing paragraphs)."""
    return tokenizer(calibration_text(words=tokens, numbers=numbers), return_tensors="pt").input_ids[:, :tokens]


def held_out_ids(tokenizer, fitted: int, tokens: int = 2048, numbers: float = 0.0) -> torch.Tensor:
    """[1, tokens] ids of the calibration text after its first `fitted` tokens (what the bases were fitted on)."""
    ids = tokenizer(calibration_text(words=2 * (fitted + tokens), numbers=numbers), return_tensors="pt").input_ids
    if ids.shape[1] < fitted + tokens:
        raise ValueError(f"the calibration text holds {ids.shape[1]} tokens, fewer than {fitted} + {tokens}")
    return ids[:, fitted: fitted + tokens]


def calibrate(
    model, input_ids: torch.Tensor, max_rank: int | None = None, text: str = CALIBRATION_TEXT
) -> tuple[dict, dict, list[dict]]:
    """Fit the bases on `input_ids` [1, T]; returns (tensors, metadata, report rows per layer)."""
    states = layer_states(model, input_ids.to(model.device))
    kv_heads, _, head_dim = states[0][0].shape
    value_dim = states[0][1].shape[-1]
    max_rank = max_rank or head_dim // 2
    if not 1 <= max_rank <= min(head_dim, value_dim):
        raise ValueError(f"max_rank must be between 1 and head_dim ({head_dim}), got {max_rank}")
    tensors, report = {}, []
    for i, (keys, values) in enumerate(states):
        row: dict[str, Any] = {"layer": i}
        for kind, x in (("key", keys), ("value", values)):
            mean, basis, variances = pca(x)
            tensors[f"layers.{i}.{kind}_mean"] = mean.contiguous()
            tensors[f"layers.{i}.{kind}_basis"] = basis[..., :max_rank].contiguous()
            tensors[f"layers.{i}.{kind}_variance"] = variances.contiguous()
            row[kind] = {r: explained(variances, r) for r in (head_dim // 8, head_dim // 4, head_dim // 2)}
        row["key_pre_rope"] = {r: explained(pca(unrotated(keys, model.config, i))[2], r)
                               for r in (head_dim // 8, head_dim // 4, head_dim // 2)}
        report.append(row)
    metadata = {"format": FORMAT, "model": model_identity(model.config), "layers": str(len(states)),
                "kv_heads": str(kv_heads), "head_dim": str(head_dim), "value_dim": str(value_dim),
                "max_rank": str(max_rank), "keys": "post_rope", "tokens": str(input_ids.shape[1]),
                "text": text}
    return tensors, metadata, report


def concatenated(states: torch.Tensor) -> torch.Tensor:
    """[H, T, D] -> [1, T, H * D]: each token's heads side by side (row h * D + d of a joint basis is head h's d)."""
    heads, tokens, dim = states.shape
    return states.permute(1, 0, 2).reshape(1, tokens, heads * dim)


VALUE_FITS = ("attention", "oblique", "pca")  # `calibrate --value-fit`: what the value bases minimise (calibrate_joint)
# Tokens `received_attention` leaves out of the values' weights: those lowrank keeps exact below a half of the
# dimensions (its 4 sinks by default and its 128-token window, codecs/lowrank.py), whose errors attention never sees.
RECEIVED_SINKS = 4
RECEIVED_WINDOW = 128
OUTPUT_GRAM_RIDGE = 0.01  # added to the W_o Gram, as a share of its mean eigenvalue: keeps its inverse root finite


def received_attention(capture: dict[str, Any], sinks: int = RECEIVED_SINKS,
                       window: int = RECEIVED_WINDOW) -> torch.Tensor:
    """[T] float64: the attention each token receives from the captured queries (summed over query heads and
    positions), leaving out the first `sinks` tokens and, for each query, the newest `window` tokens it reads."""
    keys = capture["keys"]
    heads, length, _ = keys.shape
    count = capture["query"].shape[1]
    probs = attention_weights(capture, keys).reshape(heads, -1, count, length)
    positions = torch.arange(length - count, length)
    k = torch.arange(length)
    far = (k[None] >= sinks) & (k[None] <= positions[:, None] - window)  # [Q, T]
    return (probs.double() * far).sum((0, 1, 2))


def output_gram(model, layer: int, heads: int, dim: int) -> torch.Tensor:
    """[H * D, H * D] float64, block-diagonal: per KV head h, the sum over the query heads that read it of
    W_o[:, head]^T W_o[:, head] (the output projection's Gram), so that a value error e of head h costs about
    e^T Gram e in the layer's output (ASVD, Palu)."""
    weight = text_layers(model)[layer].self_attn.o_proj.weight.detach().double()  # [hidden, Hq * D]
    groups = weight.shape[1] // dim // heads
    blocks = []
    for h in range(heads):
        columns = weight[:, h * groups * dim: (h + 1) * groups * dim].reshape(-1, groups, dim)
        blocks.append(torch.einsum("ngd,nge->de", columns, columns))
    return torch.block_diag(*blocks)


def output_weighted_pca(states: torch.Tensor, gram: torch.Tensor, weights: torch.Tensor,
                        ridge_share: float = OUTPUT_GRAM_RIDGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """states [N, W] -> (mean [W], orthonormal basis [W, W], spectrum [W]) for values read through attention: the
    decoders of `output_weighted_fit` orthonormalised in order (Gram-Schmidt), so that a rank-r latent is the
    orthogonal projection onto the span of the best rank-r decoder (one basis encodes and decodes)."""
    mean, _, decoder, spectrum = output_weighted_fit(states, gram, weights, ridge_share)
    q, r = torch.linalg.qr(decoder.double())
    return mean, (q * torch.sign(torch.diagonal(r))[None]).float(), spectrum


def output_weighted_fit(states: torch.Tensor, gram: torch.Tensor, weights: torch.Tensor,
                        ridge_share: float = OUTPUT_GRAM_RIDGE
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """states [N, W] -> (mean [W], encoder [W, W], decoder [W, W], spectrum [W]) for values read through attention.

    At every rank r, latent = (x - mean) @ encoder[:, :r] and x ~ latent @ decoder[:, :r]^T + mean minimise
    sum_n weights[n] ||(x_n - rebuilt_n) G^(1/2)||^2 (G = `gram` + ridge; ASVD, Palu): with V the eigenvectors of the
    weighted, whitened covariance by falling eigenvalue, encoder = G^(1/2) V and decoder = G^(-1/2) V (an oblique
    projection; encoder^T decoder = I). The spectrum is those eigenvalues (the weighted error each component removes,
    falling), what `allocate=variance` spreads dimensions by. mean: the plain mean of the states. Weights that are
    all zero (a sliding layer whose window the exact tokens cover: no projected token is read) count every token
    alike."""
    x = states.double()
    mean = x.mean(0)
    weights = weights.double().clamp(min=0)
    if not weights.sum() > 0:
        weights = torch.ones_like(weights)
    scaled = (x - mean) * (weights / weights.mean()).sqrt()[:, None]
    width = gram.shape[0]
    regular = gram.double() + ridge_share * torch.trace(gram.double()) / width * torch.eye(width, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(regular)
    root = vectors @ torch.diag(values.sqrt()) @ vectors.T
    inverse_root = vectors @ torch.diag(values.rsqrt()) @ vectors.T
    whitened = scaled @ root
    spectrum, directions = torch.linalg.eigh(whitened.T @ whitened / x.shape[0])
    directions = directions.flip(-1)
    return (mean.float(), (root @ directions).float(), (inverse_root @ directions).float(),
            spectrum.flip(-1).clamp(min=0).float())


def kept_share(states: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, rank: int) -> float:
    """Share of the variance of states [N, W] about `mean` that the first `rank` orthonormal columns of `basis` keep."""
    centered = states.double() - mean.double()
    return float((centered @ basis[:, :rank].double()).pow(2).sum() / centered.pow(2).sum().clamp(min=1e-30))


def calibrate_joint(model, input_ids: torch.Tensor, max_rank: int | None = None, text: str = CALIBRATION_TEXT,
                    error_ids: torch.Tensor | None = None,
                    value_fit: str = "pca") -> tuple[dict, dict, list[dict]]:
    """Fit one basis per layer and kind over the layer's KV heads on `input_ids` [1, T], keys with RoPE undone.

    Keys: plain PCA of the pre-RoPE keys. Values (`value_fit`): "pca" (the default, what the package ships), plain
    PCA; "attention", the components that lose least of the attention output after the output projection
    (`output_weighted_pca`: W_o's Gram per KV head, each token weighted by the square root of the attention it
    receives from the text's queries, `received_attention`: on held-out text it lost less of the output than the
    attention itself or its square); "oblique", that problem's exact solution with an encoder beside each basis
    (`output_weighted_fit`). The attention fits lose less of the held-out attention output than PCA but answered
    no more of the suite's test half at a quarter and less at a half on Gemma-3 (docs/results.md, "Low rank at a
    quarter: bases fitted to attention"), so they are research options.
    Tensors per layer i: `layers.i.{key,value}_mean` [H, D], `_basis` [H, D, max_rank] (the [H * D, max_rank]
    basis, row h * D + d as [h, d]), `_variance` [H * D] (every component's variance, or for attention-fitted
    values the weighted error it removes, for choosing ranks). Returns (tensors, metadata, report rows per layer:
    the share of variance kept at a quarter and a half of the dimensions, jointly and, for comparison, per head).
    With `error_ids` [1, T'] (text the bases are not fitted on), also the attention-output error curves
    (`add_error_curves`)."""
    if value_fit not in VALUE_FITS:
        raise ValueError(f"value_fit must be one of {', '.join(VALUE_FITS)}, got {value_fit!r}")
    if value_fit != "pca":  # every query's attention, for the tokens' weights
        captures = attention_captures(model, input_ids, queries=input_ids.shape[1])
        states = [(capture["keys"], capture["values"]) for capture in captures]
    else:
        states = layer_states(model, input_ids.to(model.device))
    kv_heads, _, head_dim = states[0][0].shape
    if states[0][1].shape[-1] != head_dim:
        raise ValueError("joint bases need keys and values of one width (head_dim)")
    width = kv_heads * head_dim
    max_rank = max_rank or width
    if not 1 <= max_rank <= width:
        raise ValueError(f"max_rank must be between 1 and KV heads x head_dim ({width}), got {max_rank}")
    tensors, report = {}, []
    shares = (width // 4, width // 2)
    for i, (keys, values) in enumerate(states):
        row: dict = {"layer": i}
        for kind, x in (("key", unrotated(keys, model.config, i)), ("value", values)):
            flat = concatenated(x)
            if kind == "value" and value_fit != "pca":
                gram, weights = output_gram(model, i, kv_heads, head_dim), received_attention(captures[i]).sqrt()
                if value_fit == "oblique":
                    mean, encoder, basis, variances = output_weighted_fit(flat[0], gram, weights)
                    tensors[f"layers.{i}.value_encoder"] = encoder[:, :max_rank].reshape(
                        kv_heads, head_dim, max_rank).contiguous()
                    row[kind] = {r: kept_share(flat[0], mean, torch.linalg.qr(basis[:, :r].double())[0], r)
                                 for r in shares}
                else:
                    mean, basis, variances = output_weighted_pca(flat[0], gram, weights)
                    row[kind] = {r: kept_share(flat[0], mean, basis, r) for r in shares}
                mean, basis, variances = mean[None], basis[None], variances[None]
            else:
                mean, basis, variances = pca(flat)
                row[kind] = {r: explained(variances, r) for r in shares}
            tensors[f"layers.{i}.{kind}_mean"] = mean.reshape(kv_heads, head_dim).contiguous()
            kept = basis[0, :, :max_rank]
            tensors[f"layers.{i}.{kind}_basis"] = kept.reshape(kv_heads, head_dim, max_rank).contiguous()
            tensors[f"layers.{i}.{kind}_variance"] = variances[0].contiguous()
            row[f"{kind}_per_head"] = {r: explained(pca(x)[2], r // kv_heads) for r in shares}
        report.append(row)
    metadata = {"format": FORMAT, "model": model_identity(model.config), "layers": str(len(states)),
                "kv_heads": str(kv_heads), "head_dim": str(head_dim), "value_dim": str(head_dim),
                "max_rank": str(max_rank), "keys": "pre_rope", "heads": JOINT, "tokens": str(input_ids.shape[1]),
                "text": text, "value_fit": value_fit}
    if error_ids is not None:
        add_error_curves(model, error_ids, tensors, metadata)
    return tensors, metadata, report


def save_bases(tensors: dict, metadata: dict, out_dir: str | os.PathLike) -> Path:
    path = Path(out_dir) / BASES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.half() if k.endswith(("_basis", "_mean", "_encoder")) else v for k, v in tensors.items()},
              str(path), metadata=metadata)
    return path


def calibration_file(source: str | os.PathLike | None, config, *, file_name: str, packaged_suffix: str,
                     spec_param: str, what: str, command: str) -> Path:
    """The calibration file a cache parameter names (`spec_param`, e.g. lowrank:bases): `source`, a file or a
    directory holding `file_name`, or, for None, the one shipped for `config`'s model (`packaged_suffix` after its
    identity in PACKAGED_DIR); `what` and `command` name it and the command that writes it in the errors."""
    if source is None:
        path = PACKAGED_DIR / f"{model_identity(config)}{packaged_suffix}"
        if not path.exists():
            raise ValueError(
                f"no packaged {what} for {model_identity(config)!r}: run `{command} --model M --out DIR` and pass "
                f"{spec_param}=DIR"
            )
        return path
    path = Path(source)
    if path.is_dir():
        path = path / file_name
    if not path.exists():
        raise FileNotFoundError(
            f"{spec_param.split(':')[-1]}={str(source)!r}: no {file_name} there (write it with {command})"
        )
    return path


def read_calibration(path: Path, file_format: str, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the safetensors calibration file `path`, refused unless its metadata names
    `file_format` (`what`: the kind of file, for the error)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    if metadata.get("format") != file_format:
        raise ValueError(f"{path} is not an hf-kvcompress {what} file")
    return tensors, metadata


def load_bases(source: str | os.PathLike | None, config) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read bases for `config`'s model from `source` (a file or a directory holding one; None: the packaged ones),
    refusing bases fitted on another model or shape."""
    path = calibration_file(source, config, file_name=BASES_FILE, packaged_suffix=".safetensors",
                            spec_param="lowrank:bases", what="low-rank bases", command="hf-kvcompress calibrate")
    tensors, metadata = read_calibration(path, FORMAT, "low-rank bases")
    check_fitted_for(metadata, config, f"the bases in {path}", "hf-kvcompress calibrate --model M --out DIR")
    return tensors, metadata


def check_fitted_for(metadata: dict[str, str], config, what: str, command: str) -> None:
    """Refuse a calibration file (`metadata`) fitted on another model, layer count or KV-head count than `config`'s."""
    decoder = text_config(config)
    expected = {"model": model_identity(config), "layers": str(decoder.num_hidden_layers),
                "kv_heads": str(getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads)}
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise ValueError(
                f"{what} were fitted for {key}={metadata.get(key)!r}, this model has {key}={value!r}: calibrate "
                f"this model ({command})"
            )


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares with an L2 term on the weights (not the bias), closed form, in float64:
    argmin_{W, b} ||x W + b - y||^2 + alpha ||W||^2. x [N, d], y [N, k] -> (W [d, k], b [k])."""
    x, y = x.double(), y.double()
    mean_x, mean_y = x.mean(0), y.mean(0)
    xc, yc = x - mean_x, y - mean_y
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype)
    weight = torch.linalg.solve(gram, xc.T @ yc)
    return weight, mean_y - mean_x @ weight


# -- head sharing (`shared_heads:ratio=`) ---------------------------------------------------------------------------

SHARING_FILE = "shared_heads.safetensors"
SHARING_FORMAT = "hf-kvcompress-shared-heads-1"


def least_squares(targets: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """targets [N, m], inputs [N, k] -> (map [m, k], bias [m], mean squared residual [m]) of the affine least-squares
    fit targets ~ inputs @ map.T + bias (`ridge` with a strength of 1e-6 of the inputs' mean variance, which keeps it
    defined when two inputs are collinear)."""
    x, y = inputs.double(), targets.double()
    xc = x - x.mean(0)
    weights, bias = ridge(x, y, 1e-6 * float((xc * xc).sum(0).mean().clamp(min=1e-30)))
    residual = ((y - (x @ weights + bias)) ** 2).mean(0)
    return weights.T, bias, residual


def sharing_levels(states: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """states [H, T, D] (keys pre-RoPE, or values) -> one entry per level m = 1 .. H-1 (m heads predicted from the
    H - m kept ones): `kept` [H - m], `predicted` [m] (head indices), `map` [m, D, (H - m) * D], `bias` [m, D]
    (each predicted head as an affine least-squares map of the kept heads concatenated) and `cost` (the predicted
    heads' mean squared residual over the mean squared state of all H heads).

    Greedy and nested: level m + 1 predicts one more head than level m, the one whose removal from the kept heads
    costs least (so a ratio that takes a layer's first level and then its second finds the second's kept heads
    among the first's)."""
    heads, _, dim = states.shape
    x = states.double()
    scale = float((x ** 2).mean()) * heads * dim  # the mean squared norm of the H heads together
    kept, levels = list(range(heads)), []
    for _ in range(heads - 1):
        # (cost, kept, predicted, map, bias) of the cheapest next head to predict
        best: tuple[float, list[int], list[int], torch.Tensor, torch.Tensor] | None = None
        for drop in kept:
            keep = [h for h in kept if h != drop]
            predicted = [h for h in range(heads) if h not in keep]
            inputs = x[keep].permute(1, 0, 2).reshape(x.shape[1], -1)  # [T, k * D]: the kept heads side by side
            targets = x[predicted].permute(1, 0, 2).reshape(x.shape[1], -1)
            weights, bias, residual = least_squares(targets, inputs)
            cost = float(residual.sum()) / scale
            if best is None or cost < best[0]:
                best = (cost, keep, predicted, weights, bias)
        assert best is not None  # at least two heads were kept
        cost, kept, predicted, weights, bias = best
        levels.append({"kept": torch.tensor(kept), "predicted": torch.tensor(predicted),
                       "map": weights.reshape(len(predicted), dim, len(kept) * dim).float(),
                       "bias": bias.reshape(len(predicted), dim).float(), "cost": torch.tensor(cost)})
    return levels


def calibrate_sharing(model, input_ids: torch.Tensor, text: str = CALIBRATION_TEXT) -> tuple[dict, dict, list[dict]]:
    """Measure which KV heads of each layer can be predicted from the others, and fit the maps (`shared_heads:ratio`).

    Tensors per layer i, kind k (key: with RoPE undone, so one map serves every position; value) and level m:
    `layers.i.k.m.{kept,predicted,map,bias,cost}` (`sharing_levels`). Returns (tensors, metadata, report rows:
    each layer's cost per level and kind)."""
    states = layer_states(model, input_ids.to(model.device))
    kv_heads, _, head_dim = states[0][0].shape
    if kv_heads < 2:
        raise ValueError(
            "head sharing needs at least two KV heads per layer; this model has one (its query heads already share)"
        )
    if states[0][1].shape[-1] != head_dim:
        raise ValueError("head sharing needs keys and values of one width (head_dim)")
    tensors, report = {}, []
    for i, (keys, values) in enumerate(states):
        row: dict[str, Any] = {"layer": i}
        for kind, x in (("key", unrotated(keys, model.config, i)), ("value", values)):
            levels = sharing_levels(x)
            for m, level in enumerate(levels, start=1):
                for name, tensor in level.items():
                    tensors[f"layers.{i}.{kind}.{m}.{name}"] = tensor.contiguous()
            row[kind] = [float(level["cost"]) for level in levels]
            row[f"{kind}_predicted"] = [level["predicted"].tolist() for level in levels]
        report.append(row)
    metadata = {"format": SHARING_FORMAT, "model": model_identity(model.config), "layers": str(len(states)),
                "kv_heads": str(kv_heads), "head_dim": str(head_dim), "keys": "pre_rope",
                "tokens": str(input_ids.shape[1]), "text": text}
    return tensors, metadata, report


def save_sharing(tensors: dict, metadata: dict, out_dir: str | os.PathLike) -> Path:
    path = Path(out_dir) / SHARING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.half() if k.endswith(".map") else v for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def load_sharing(source: str | os.PathLike | None, config) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read head-sharing maps for `config`'s model from `source` (a file or a directory holding one; None: the
    packaged ones), refusing maps fitted on another model or shape."""
    path = calibration_file(source, config, file_name=SHARING_FILE, packaged_suffix=".shared_heads.safetensors",
                            spec_param="shared_heads:maps", what="head-sharing maps",
                            command="hf-kvcompress calibrate --sharing")
    tensors, metadata = read_calibration(path, SHARING_FORMAT, "head-sharing")
    check_fitted_for(metadata, config, f"the head-sharing maps in {path}",
                     "hf-kvcompress calibrate --sharing --model M --out DIR")
    return tensors, metadata


# -- key channel scales (int codecs' `key_scale`) -------------------------------------------------------------------

KEY_SCALES_FILE = "key_scales.safetensors"
KEY_SCALES_FORMAT = "hf-kvcompress-key-scales-1"
KEY_SCALES_SUFFIX = ".key_scales.safetensors"
KEY_SCALE_STATS = ("absmax", "rms", "p99")
# The first tokens are left out of the statistics: the int codecs keep them exact (sinks), and the first token's keys
# are often far larger than the rest (they would set the scale of channels that no other token fills).
KEY_SCALE_SKIP = 4


def channel_spread(keys: torch.Tensor, stat: str) -> torch.Tensor:
    """keys [H, T, D] -> [H, D]: each channel's largest magnitude (`absmax`), root mean square (`rms`) or 99th
    percentile of magnitudes (`p99`) over the tokens, at least 1e-6 (a channel never divides by zero)."""
    magnitude = keys.float().abs()
    if stat == "absmax":
        spread = magnitude.amax(1)
    elif stat == "rms":
        spread = magnitude.pow(2).mean(1).sqrt()
    elif stat == "p99":
        spread = magnitude.quantile(0.99, dim=1)
    else:
        raise ValueError(f"stat must be one of {KEY_SCALE_STATS}, got {stat!r}")
    return spread.clamp(min=1e-6)


def calibrate_key_scales(model, input_ids: torch.Tensor, stat: str = "absmax",
                         text: str = CALIBRATION_TEXT) -> tuple[dict, dict, list[dict]]:
    """Each layer's key channel scales on `input_ids` [1, T] (keys after RoPE, as the cache receives them; the
    first KEY_SCALE_SKIP tokens left out): `layers.i.key_scale` [H, D] (`channel_spread`). Returns (tensors,
    metadata, report rows: each layer's widest channel over its median, the spread the scales even out)."""
    if input_ids.shape[1] <= KEY_SCALE_SKIP:
        raise ValueError(f"key scales need more than {KEY_SCALE_SKIP} calibration tokens, got {input_ids.shape[1]}")
    states = layer_states(model, input_ids.to(model.device))
    kv_heads, _, head_dim = states[0][0].shape
    tensors, report = {}, []
    for i, (keys, _) in enumerate(states):
        scale = channel_spread(keys[:, KEY_SCALE_SKIP:], stat)
        tensors[f"layers.{i}.key_scale"] = scale.contiguous()
        report.append({"layer": i, "widest_over_median": float((scale.amax(-1) / scale.median(-1).values).max())})
    metadata = {"format": KEY_SCALES_FORMAT, "model": model_identity(model.config), "layers": str(len(states)),
                "kv_heads": str(kv_heads), "head_dim": str(head_dim), "stat": stat, "keys": "post_rope",
                "tokens": str(input_ids.shape[1]), "text": text}
    return tensors, metadata, report


def save_key_scales(tensors: dict, metadata: dict, out_dir: str | os.PathLike) -> Path:
    path = Path(out_dir) / KEY_SCALES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def key_scales_file(source: str | os.PathLike | None, config) -> Path | None:
    """The key-scales file `source` names (a file, or a directory holding one), or for None the one shipped for
    `config`'s model, or None when no file is shipped for it."""
    if source is None and not (PACKAGED_DIR / f"{model_identity(config)}{KEY_SCALES_SUFFIX}").exists():
        return None
    return calibration_file(source, config, file_name=KEY_SCALES_FILE, packaged_suffix=KEY_SCALES_SUFFIX,
                            spec_param="key_scale", what="key scales", command="hf-kvcompress calibrate --key-scales")


def load_key_scales(path: Path, config) -> torch.Tensor:
    """[layers, H, D] float32 key channel scales from `path` (`key_scales_file`), refusing a file fitted on another
    model or shape."""
    tensors, metadata = read_calibration(path, KEY_SCALES_FORMAT, "key scales")
    check_fitted_for(metadata, config, f"the key scales in {path}", "hf-kvcompress calibrate --key-scales --model M "
                     "--out DIR")
    return torch.stack([tensors[f"layers.{i}.key_scale"].float() for i in range(int(metadata["layers"]))])


FLOORS_FILE = "layer_floors.safetensors"
FLOORS_FORMAT = "hf-kvcompress-layer-floors-1"
FLOORS_SUFFIX = ".layer_floors.safetensors"


def save_floors(tensors: dict, metadata: dict, out_dir: str | os.PathLike) -> Path:
    """Write KVzip's per-layer floors (floor_calibration.py): `ratios` [K], `layers` [L] (the full-attention layers'
    indices) and `floors` [K, L] (the share of the document each keeps at least at each ratio)."""
    path = Path(out_dir)
    if path.suffix != ".safetensors":
        path = path / FLOORS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def floors_file(source: str | os.PathLike | None, config) -> Path | None:
    """The layer-floors file `source` names (a file, or a directory holding one), or for None the one shipped for
    `config`'s model, or None when no file is shipped for it (or the config names no model)."""
    if source is None:
        named = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
        if not named or not (PACKAGED_DIR / f"{model_identity(config)}{FLOORS_SUFFIX}").exists():
            return None
    return calibration_file(source, config, file_name=FLOORS_FILE, packaged_suffix=FLOORS_SUFFIX,
                            spec_param="kvzip:floors", what="layer floors", command="hf-kvcompress calibrate --floors")


def load_floors(path: Path, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ratios [K], layers [L], floors [K, L]) from `path` (`floors_file`), refusing a file fitted on another model
    or shape."""
    tensors, metadata = read_calibration(path, FLOORS_FORMAT, "layer floors")
    check_fitted_for(metadata, config, f"the layer floors in {path}", "hf-kvcompress calibrate --floors --model M "
                     "--out DIR")
    return tensors["ratios"].double(), tensors["layers"].long(), tensors["floors"].double()


# -- attention-output error of the joint bases (ranks by what attention reads, not by variance) ---------------------

CAPTURE_NAME = "kvcompress_capture"
ERROR_STEP = 8  # ranks at which `error_curves` measures a layer's error (the codec's finest rank step)


class _Captures:
    """What one forward pass's attention calls received, per layer (the call's module.layer_idx)."""

    def __init__(self, queries: int):
        self.queries = queries
        self.layers: dict[int, dict[str, Any]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        self.layers[module.layer_idx] = {
            "query": query[0, :, -self.queries:].detach().float(),  # [Hq, Q, D] post-RoPE, the last Q positions
            "keys": key[0].detach().float(), "values": value[0].detach().float(),  # [H, T, D], keys post-RoPE
            "scaling": float(scaling if scaling is not None else module.scaling),
            "window": sliding_window, "softcap": kwargs.get("softcap"),
        }
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)


@torch.inference_mode()
def attention_captures(model, input_ids: torch.Tensor, queries: int = 256) -> list[dict[str, Any]]:
    """Per layer: the last `queries` queries [Hq, Q, D], every key (post-RoPE) and value [H, T, D], the scaling,
    sliding window and softcap of one forward pass over `input_ids` [1, T]."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captures = _Captures(queries)
    AttentionInterface.register(CAPTURE_NAME, captures)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)
    decoder = text_config(model.config)
    before = decoder._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        model(input_ids=input_ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return [captures.layers[i] for i in range(len(captures.layers))]


def attention_weights(capture: dict[str, Any], keys: torch.Tensor) -> torch.Tensor:
    """The captured queries' attention weights [H, G * Q, T] over `keys` [H, T, D] (causal, the layer's sliding
    window and softcap; row g * Q + q: query head h * G + g at the q-th captured position)."""
    query = capture["query"]
    heads, length, _ = keys.shape
    groups = query.shape[0] // heads
    count = query.shape[1]
    q = query.reshape(heads, groups * count, -1)
    logits = (q @ keys.float().transpose(1, 2)) * capture["scaling"]
    if capture["softcap"]:
        logits = torch.tanh(logits / capture["softcap"]) * capture["softcap"]
    positions = torch.arange(length - count, length).repeat(groups)  # each query's position
    k = torch.arange(length)
    allowed = k[None] <= positions[:, None]
    if capture["window"]:
        allowed &= k[None] > positions[:, None] - capture["window"]
    return logits.masked_fill(~allowed[None], float("-inf")).softmax(-1)


def projected_output(model, layer: int, capture: dict[str, Any], weights: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s attention output after its output projection [Q, hidden] for `weights` [H, G * Q, T] (as
    `attention_weights` gives them) and `values` [H, T, D]."""
    query_heads, count, _ = capture["query"].shape
    out = (weights @ values.float()).reshape(query_heads, count, -1)  # query head h * G + g reads KV head h
    weight = text_layers(model)[layer].self_attn.o_proj.weight.detach().float()
    return out.transpose(0, 1).reshape(count, -1) @ weight.T


def output_error(model, capture: dict[str, Any], states: tuple[torch.Tensor, torch.Tensor], layer: int,
                 weights: torch.Tensor | None = None) -> float:
    """Relative squared error of layer `layer`'s attention output after its output projection when it reads
    `states` (keys post-RoPE, values [H, T, D]) instead of the captured ones (`weights`: the attention weights
    over states' keys, when the caller has them)."""
    reference = capture.get("output")
    if reference is None:
        reference = capture["output"] = projected_output(
            model, layer, capture, attention_weights(capture, capture["keys"]), capture["values"])
    if weights is None:
        weights = attention_weights(capture, states[0])
    approx = projected_output(model, layer, capture, weights, states[1])
    return float((approx - reference).pow(2).sum() / reference.pow(2).sum().clamp(min=1e-30))


def text_layers(model):
    """The decoder layers of `model` (a causal LM, or a multimodal one's text model)."""
    inner = model.model
    inner = getattr(inner, "language_model", inner)
    return inner.layers


def _joint_basis(tensors: dict[str, torch.Tensor], layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [H * D], orthonormal basis [H * D, max_rank]) of a joint bases file, as the codec reads them."""
    mean = tensors[f"layers.{layer}.{kind}_mean"].double().reshape(-1)
    basis = tensors[f"layers.{layer}.{kind}_basis"].double()
    q, r = torch.linalg.qr(basis.reshape(mean.numel(), -1))
    return mean, q * torch.sign(torch.diagonal(r))[None]


def _projected(states: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, rank: int,
               tensors: dict[str, torch.Tensor] | None = None, name: str = "") -> torch.Tensor:
    """states [H, T, D] reconstructed from their first `rank` coordinates on a joint basis; with `tensors` holding
    `name` (an oblique kind's encoder), encoded with it and rebuilt with the file's basis made biorthogonal to it
    at that rank, as the codec does (`LayerBases`)."""
    heads, length, dim = states.shape
    flat = states.double().transpose(0, 1).reshape(length, heads * dim) - mean
    if tensors is not None and name in tensors:
        encoder = tensors[name][..., :rank].double().reshape(heads * dim, rank)
        decoder = tensors[name.replace("_encoder", "_basis")][..., :rank].double().reshape(heads * dim, rank)
        decoder = decoder @ torch.linalg.inv(encoder.T @ decoder)
        return ((flat @ encoder) @ decoder.T + mean).reshape(length, heads, dim).transpose(0, 1)
    kept = basis[:, :rank]
    return ((flat @ kept) @ kept.T + mean).reshape(length, heads, dim).transpose(0, 1)


def joint_reconstruction(config, tensors: dict[str, torch.Tensor], layer: int, capture: dict[str, Any],
                         ranks: tuple[int | None, int | None], sinks: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured keys (post-RoPE) and values of `layer` as the joint bases at `ranks` (key, value) rebuild
    them (keys projected with RoPE undone, then rotated back); None leaves that kind exact; the first `sinks`
    tokens stay exact (as lowrank's `sink_tokens` keep them)."""
    keys, values = capture["keys"], capture["values"]
    exact_keys, exact_values = keys, values
    key_rank, value_rank = ranks
    if key_rank is not None:
        plain = unrotated(keys, config, layer)
        rebuilt = _projected(plain, *_joint_basis(tensors, layer, "key"), key_rank).float()
        inv_freq = torch.tensor(rope_frequencies(config)[layer])
        positions = torch.arange(keys.shape[1], dtype=torch.float32).expand(keys.shape[0], -1)
        keys = rerotate(rebuilt[None], positions[None], inv_freq)[0]
    if value_rank is not None:
        values = _projected(values, *_joint_basis(tensors, layer, "value"), value_rank, tensors,
                            f"layers.{layer}.value_encoder").float()
    if sinks:
        keys = torch.cat([exact_keys[:, :sinks], keys[:, sinks:]], 1)
        values = torch.cat([exact_values[:, :sinks], values[:, sinks:]], 1)
    return keys, values


def error_curves(model, captures: list[dict[str, Any]], tensors: dict[str, torch.Tensor], step: int = ERROR_STEP,
                 max_rank: int | None = None) -> list[tuple[list[float], list[float]]]:
    """Per layer, (key errors, value errors): the relative attention-output error (`output_error`) with one kind
    rebuilt at ranks 0, step, 2 step, ... up to `max_rank` (or the width) and the other kind exact."""
    curves = []
    for layer, capture in enumerate(captures):
        heads, _, dim = capture["keys"].shape
        top = min(heads * dim, max_rank or heads * dim)
        ranks = range(0, top + 1, step)
        exact = attention_weights(capture, capture["keys"])
        key = [output_error(model, capture, joint_reconstruction(model.config, tensors, layer, capture, (r, None)),
                            layer) for r in ranks]
        value = [output_error(model, capture, joint_reconstruction(model.config, tensors, layer, capture, (None, r)),
                              layer, exact) for r in ranks]
        curves.append((key, value))
    return curves


ERROR_QUERIES = 256  # the calibration text's last tokens whose attention output `add_error_curves` measures


def add_error_curves(model, input_ids: torch.Tensor, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                     queries: int = ERROR_QUERIES) -> None:
    """Add each layer's attention-output error curves (`error_curves` on `input_ids`: text the bases were not fitted
    on, since on their own text they lose far less than on any other) to joint bases:
    `layers.i.{key,value}_error` [max_rank // ERROR_STEP + 1], the error at ranks 0, ERROR_STEP, ...; lowrank's
    `allocate=error` spends a ratio's dimensions by them."""
    if metadata.get("heads") != JOINT:
        raise ValueError("attention-error curves are measured for joint bases (hf-kvcompress calibrate --heads joint)")
    captures = attention_captures(model, input_ids, queries)
    curves = error_curves(model, captures, tensors, ERROR_STEP, int(metadata["max_rank"]))
    for layer, (key, value) in enumerate(curves):
        tensors[f"layers.{layer}.key_error"] = torch.tensor(key, dtype=torch.float32)
        tensors[f"layers.{layer}.value_error"] = torch.tensor(value, dtype=torch.float32)
    metadata.update(error_step=str(ERROR_STEP), error_queries=str(queries))


def has_error_curves(tensors: dict[str, torch.Tensor]) -> bool:
    return "layers.0.key_error" in tensors


def has_copy_weights(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether joint bases hold `layers.i.copy_weight` (copy_weights.py), what lowrank's `allocate=copy` reads."""
    return "layers.0.copy_weight" in tensors
