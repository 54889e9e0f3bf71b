"""Low rank: keys and values stored as their coordinates on calibrated bases (fewer numbers than head_dim).

Two kinds of bases (`hf-kvcompress calibrate` writes the first; `calibration.calibrate` the second):
- joint: one basis per layer and kind over the layer's KV heads concatenated, keys before RoPE (the codec undoes
  RoPE at each key's position before projecting and turns the decoded key back), ranks per layer chosen from the
  calibrated variances or attention-output errors (`ratio`); keys by PCA, values fitted to the attention output
  (`calibration.output_weighted_pca`), or with an encoder of their own beside the basis (oblique bases);
- per head: one basis per KV head, keys after RoPE as the cache receives them, one `rank` in every layer.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from ..calibration import ERROR_STEP, JOINT, has_copy_weights, has_error_curves, load_bases, rope_frequencies
from ..hf.compat import text_config
from ..ops import cpu_decode
from ..ops.bf16_matmul import fast_bfloat16_matmul
from ..ops.rerotate import rerotate, rope_turns
from .base import Encoded, Kind
from .identity import IdentityCodec
from .reducing import ReducingCodec

DEFAULT_RATIO = 0.25  # the lesson's 128 -> 32
# The newest tokens a ratio below a half keeps exact unless `residual_length` is given: chosen on SmolLM2's development
# half (a quarter: no window 0 / 10, 32 tokens 7 / 10, 128 tokens 8 / 10; docs/results.md); a half answered its
# needles without one (by variance).
WINDOW_BELOW_HALF = 128
# From a half on, beside a storage that keeps a residual of its own (`+int4`), the newest tokens kept whole (the
# question's and the answer's own tokens; the rest of the storage's residual holds latents, `residual_codec`): chosen
# on the development halves (Gemma-3: none 10 / 11, 32 and 64 tokens 11 / 11; SmolLM2 10 / 10 with none and with 32;
# docs/results.md, "Low rank at 2x + int4: the residual as latents").
WINDOW_IN_STACK = 32
# What `int4` means stored under a ratio from a half on, where the spec does not say (`storage_defaults`): 32 newest
# tokens at full precision instead of 128, all of them lowrank's whole window (WINDOW_IN_STACK), so that of the
# residual only the unfinished per-channel key group is held as latents. Chosen on the development halves of both
# models, where it kept every answer int4's 128 kept, at 0.179 of the bf16 bytes instead of 0.196 (SmolLM2) and 0.210
# instead of 0.248 (Gemma-3); scale groups of 64 (fewer scales) lost a Gemma-3 answer there, so int4 keeps its 32
# (docs/results.md, "Low rank at 2x + int4 nearer an eighth"). Per-kind groups (keys over 128 tokens, values over 64
# latents) kept every development answer on both models, but are not the default: on Gemma-3's 512-token sliding
# windows the unfinished 128-token key group held as latents outweighs the scales saved at 2,000 tokens, and value
# groups of 64 would refuse latent widths that 64 does not divide (docs/results.md, "Low rank at 2x + int4: each
# kind's scale groups").
INT4_IN_STACK: dict[str, int] = {"residual_length": 32}
# The prompt length at which a ratio on a model with sliding-window layers is a share of the latents' bytes
# (`length`): the suite's prompts (needle, multi_question at 2,000 tokens).
BYTES_AT_LENGTH = 2000


class LayerBases:
    """One layer's means [H, D], bases [H, D, r] (a joint basis: row h * D + d of the [H * D, r] matrix is [h, d];
    what a latent is rebuilt with) and encoders [H, D, r] (what a state is projected with: the basis itself, or for
    a file that holds `{kind}_encoder`, an oblique projection's own encoder) and its RoPE frequencies (joint bases turn
    keys on read; empty otherwise), shared by every cache of the model like its weights.

    No `__dict__`: `measured_kv_bytes` counts what each user's cache holds, and these are per model, not per user
    (`LowRankCodec.model_bytes` counts them, once per model).
    """

    __slots__ = ("key_mean", "key_basis", "key_encoder", "value_mean", "value_basis", "value_encoder", "inv_freq",
                 "kernel_keys")
    key_mean: torch.Tensor
    key_basis: torch.Tensor
    key_encoder: torch.Tensor
    value_mean: torch.Tensor
    value_basis: torch.Tensor
    value_encoder: torch.Tensor
    inv_freq: torch.Tensor
    # The key basis as the CPU kernel reads it (`key_basis_for_kernel`), per compute dtype: made at the first step.
    kernel_keys: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]]

    def __init__(self, tensors: dict[str, torch.Tensor], layer_idx: int, ranks: tuple[int, int], joint: bool,
                 inv_freq: tuple[float, ...] = (), whole_values: bool = False):
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32)
        self.kernel_keys = {}
        for kind, rank in zip(("key", "value"), ranks, strict=True):
            if kind == "value" and whole_values:
                self._whole_values(tensors[f"layers.{layer_idx}.key_mean"].shape, rank)
                continue
            mean = tensors[f"layers.{layer_idx}.{kind}_mean"].float()
            basis = tensors[f"layers.{layer_idx}.{kind}_basis"][..., :rank].float()
            encoder = None  # an orthonormal basis encodes too
            oblique = f"layers.{layer_idx}.{kind}_encoder"
            if joint and oblique in tensors:
                # The file holds both in half precision: rescale the decoder so that encoder^T basis = I again, so
                # that a latent rebuilds what it encodes (a projection) and at full rank every state exactly.
                heads, dim, _ = basis.shape
                enc = tensors[oblique][..., :rank].double().reshape(heads * dim, rank)
                dec = basis.double().reshape(heads * dim, rank)
                dec = dec @ torch.linalg.inv(enc.T @ dec)
                encoder, basis = enc.float().reshape(heads, dim, rank), dec.float().reshape(heads, dim, rank)
            elif joint:
                # The file holds the basis in half precision: orthonormalise it again, so that a full-rank basis
                # reconstructs every state exactly and a lower rank is an exact projection onto its span.
                heads, dim, _ = basis.shape
                q, r = torch.linalg.qr(basis.reshape(heads * dim, rank).double())
                basis = (q * torch.sign(torch.diagonal(r))[None]).float().reshape(heads, dim, rank)
            basis = basis.contiguous()
            setattr(self, f"{kind}_mean", mean.contiguous())
            setattr(self, f"{kind}_basis", basis)
            setattr(self, f"{kind}_encoder", basis if encoder is None else encoder.contiguous())

    def _whole_values(self, shape: torch.Size, rank: int) -> None:
        """Values kept whole (lowrank's `kinds="keys"`): a zero mean and the identity as the joint basis [H, D, H * D]
        (row h * D + d of the [H * D, H * D] matrix is [h, d]), so that a value's latent is its heads concatenated
        and every path that reads joint value latents (the block reads, the C++ kernel) reads the values exactly."""
        heads, dim = shape
        if rank != heads * dim:
            raise ValueError(f"whole values keep all {heads * dim} dimensions of a layer, got rank {rank}")
        self.value_mean = torch.zeros(heads, dim)
        self.value_basis = torch.eye(heads * dim).reshape(heads, dim, heads * dim)
        self.value_encoder = self.value_basis

    def on(self, device: torch.device) -> LayerBases:
        """These bases on `device`, moved there once: a layer's bases belong to one cache (`for_layer`), so the
        decode step reads them without a host-to-device copy per layer and step."""
        if self.key_basis.device != device:
            for kind in ("key", "value"):
                basis, encoder = getattr(self, f"{kind}_basis"), getattr(self, f"{kind}_encoder")
                setattr(self, f"{kind}_mean", getattr(self, f"{kind}_mean").to(device))
                setattr(self, f"{kind}_basis", basis.to(device))
                # An orthonormal basis is its own encoder: one tensor, moved once.
                setattr(self, f"{kind}_encoder", getattr(self, f"{kind}_basis") if encoder is basis
                        else encoder.to(device))
            self.inv_freq = self.inv_freq.to(device)
            self.kernel_keys = {}
        return self

    def key_basis_for_kernel(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The key basis as `cpu_decode.lowrank_decode_attention` reads it for products in `compute`: [H, r, D] float32
        (rounded to bf16 for bf16 products) and, for bf16 products, the bf16 pairs (`cpu_decode.bf16_pairs`); made
        once per layer and dtype. Like the bases they hold the model's numbers, not a user's (so `measured_kv_bytes`
        does not count them); `model_bytes` counts the bases as loaded, not these copies (1.5x the key basis's bytes
        for bf16 products)."""
        if compute not in self.kernel_keys:
            basis = self.key_basis
            rounded = basis.to(compute).float() if compute != torch.float32 else basis
            pairs = cpu_decode.bf16_pairs(basis) if compute == torch.bfloat16 else None
            self.kernel_keys[compute] = (rounded.transpose(1, 2).contiguous(), pairs)
        return self.kernel_keys[compute]


class TurnTables:
    """The cos and sin of RoPE's turn at a decode step's slot positions, shared by the layers of one cache that hold
    the same positions and frequencies (every layer, unless a policy evicts per layer): one table per step instead
    of one per layer (each costs about what the layer's turn does at long contexts on one CPU core).

    Transient: the last of the layers bound to these tables (`register`; a hybrid model binds its sliding and its
    full-attention layers apart) drops them when it has read its store's last block, so between steps nothing is
    held (and `measured_kv_bytes`, which walks the codec, would count whatever were). At most MAX_ENTRIES tables (a
    store read in several blocks holds one per block); a miss beyond that drops the oldest.
    CPU tensors only: matching positions on a GPU would read the device on the host at every layer, where the
    table's few launches cost less than that read.
    """

    MAX_ENTRIES = 4

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.last_layer = -1  # the highest layer index bound to these tables

    def register(self, layer_idx: int) -> None:
        """A layer of the cache reads these tables."""
        self.last_layer = max(self.last_layer, layer_idx)

    def lookup(self, inv_freq: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, R / 2, T] of `position` [B, 1, T] (float32) at `inv_freq` [R / 2]: built, or one held
        for equal frequencies and positions. The comparison reads CPU memory only (no device to wait for)."""
        if position.device.type == "cpu":
            for freq, held, cos, sin in self.entries:
                if held.shape == position.shape and freq.shape == inv_freq.shape \
                        and np.array_equal(held.numpy(), position.numpy()) \
                        and np.array_equal(freq.numpy(), inv_freq.numpy()):
                    return cos, sin
        angles = inv_freq[:, None] * position[:, :, None, :]  # [B, 1, R / 2, T]
        cos, sin = angles.cos(), angles.sin()
        if position.device.type == "cpu":
            # Copies: the layer's positions may change in place later (a crop, a reorder), the held key must not.
            self.entries.append((inv_freq.clone(), position.clone(), cos, sin))
            del self.entries[: -self.MAX_ENTRIES]
        return cos, sin

    def release(self) -> None:
        self.entries.clear()


# Columns of one bf16 key product (`_product_in_chunks`): every product of a layer has the same shape.
KEY_CHUNK = 1024
# Query rows per KV head up to which a CPU step reads the layer in the C++ kernel (`attend_layer`): a decode step's few
# rows. A prefill chunk's hundreds go through BLAS, whose products of many rows outrun the kernel's per-row FMAs.
KERNEL_ROWS = 64
# Tokens up to which a CPU encoding runs in the C++ kernel (`_encode_in_kernel`): a decode step's one token costs a
# dozen tensor ops' dispatch in PyTorch, far more than its products; a prompt's thousands go through BLAS.
ENCODE_KERNEL_TOKENS = 16


def _product_in_chunks(basis: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """basis [M, r] x latent [N, r]^T in float32 [M, N], computed in basis's dtype (bf16) KEY_CHUNK columns at a time,
    the last chunk padded with zero rows.

    Every product then has the same shape, whatever the number of tokens: oneDNN, which runs CPU bf16 products,
    compiles and keeps a primitive per shape it has seen (up to 1,024 of them, each holding memory), so a product of
    all N tokens at once, whose N grows at every decode step, grew the process at every step and paid a compilation
    each time (docs/speed.md, "Low rank's float32 decode"). The bf16 outputs are widened to float32 as they are
    placed (the mean, the turn and the query's product run in float32): a mixed-dtype add of the float32 mean to a
    bf16 product costs several times the product on CPU."""
    rows, rank = latent.shape
    padded = torch.empty(-(-rows // KEY_CHUNK) * KEY_CHUNK, rank, dtype=basis.dtype, device=latent.device)
    padded[:rows] = latent  # converted on the way in
    padded[rows:] = 0
    out = torch.empty(basis.shape[0], rows, dtype=torch.float32, device=basis.device)
    for start in range(0, rows, KEY_CHUNK):
        end = min(start + KEY_CHUNK, rows)
        out[:, start:end] = torch.mm(basis, padded[start : start + KEY_CHUNK].t())[:, : end - start]
    return out


FLOORS = ("none", "full")  # lowrank's `floor`: which layers keep at least the ratio of each kind's dimensions
COMPUTE_DTYPES = ("auto", "bfloat16", "float32")  # lowrank's `compute`: the dtype of a decode step's key rebuild
# The kinds whose latents a float32 model stores in bf16 where its decode step computes in bf16 (`latent_dtype`).
BF16_LATENTS = ("key", "value")
ALLOCATIONS = ("copy", "error", "variance")  # lowrank's `allocate`: what a ratio's dimensions are spread by
# lowrank's `kinds`: what is projected on the bases. "keys": the keys only; the values go to the storage whole.
PROJECTED_KINDS = ("both", "keys")


def allocate_ranks(variances: list[tuple[torch.Tensor, torch.Tensor]], ratio: float, step: int,
                   max_rank: int, floored: tuple[bool, ...] | None = None,
                   costs: tuple[float, ...] | None = None, kinds: tuple[int, ...] = (0, 1)) -> list[tuple[int, int]]:
    """Per-layer (key rank, value rank) keeping `ratio` of all layers' dimensions, in steps of `step`.

    Each (layer, kind) ranks its components by the share of its own variance they hold; the kept dimensions go to
    the steps that hold the largest shares anywhere (so every layer stops at about the same share of its variance
    left, the variance target that `ratio` stands for). Every layer and kind keeps at least one step and at most
    `max_rank` (what the bases hold); a layer marked in `floored` keeps at least `ratio` of each kind's dimensions
    (in whole steps, at most `max_rank`), paid for by the other layers' smallest steps. `costs`: what a dimension
    of each layer costs (`layer_costs`: the tokens it is stored for); then `ratio` is a share of the dimensions
    counted at their costs, and a step goes where its share of variance per cost is largest. None: every layer
    alike. `kinds`: the kinds allocated (0 keys, 1 values; `ratio` is then a share of those kinds' dimensions); a
    kind left out keeps one step (its caller stores it otherwise)."""
    width = variances[0][0].numel()
    steps = width // step
    cost = costs if costs is not None else (1.0,) * len(variances)
    floor = min(max(1, round(ratio * steps)), max_rank // step)
    lowest = [floor if floored is not None and floored[layer] else 1 for layer in range(len(variances))]
    gains: list[tuple[float, int, int, int]] = []
    for layer, pair in enumerate(variances):
        for k, v in enumerate(pair):
            if k not in kinds:
                continue
            share = v.double().clamp(min=0) / v.double().clamp(min=0).sum().clamp(min=1e-30)
            chunks = share[: steps * step].reshape(steps, step).sum(-1) / cost[layer]
            gains.extend((float(chunks[c]), layer, k, c) for c in range(lowest[layer], min(steps, max_rank // step)))
    ranks = [[step * low, step * low] for low in lowest]
    budget = _step_budget(ratio, steps, cost, len(kinds)) \
        - sum(len(kinds) * low * cost[layer] for layer, low in enumerate(lowest))
    # Shares fall along each (layer, kind), and a layer's steps cost alike, so the largest gains anywhere are prefixes
    # of each; a step that no longer fits the budget is passed over for cheaper ones.
    for _, layer, k, _ in sorted(gains, key=lambda g: (-g[0], g[1], g[2], g[3])):
        if cost[layer] <= budget + _SLACK:
            ranks[layer][k] += step
            budget -= cost[layer]
    return [(key, value) for key, value in ranks]


# Budgets in cost units are sums of floats: a step that fits up to rounding fits (with unit costs every sum is exact).
_SLACK = 1e-9


def _step_budget(ratio: float, steps: int, costs: tuple[float, ...], kinds: int = 2) -> float:
    """`ratio` of all layers' steps of `kinds` kinds (keys and values: 2), counted at their layers' costs (unit
    costs: a whole number of steps, rounded as before costs existed)."""
    if all(c == 1.0 for c in costs):
        return float(round(ratio * len(costs) * kinds * steps))
    return ratio * kinds * steps * sum(costs)


def layer_costs(layer_types: list[str], window: int, length: int, exact: int) -> tuple[float, ...] | None:
    """What a dimension of each layer costs in a model with sliding-window layers: the tokens its latents hold at a
    prompt of `length` tokens, relative to a full-attention layer's. A sliding layer holds its window (transformers
    keeps `window - 1` tokens) and a full-attention layer every token, less the `exact` newest tokens and sinks each
    keeps exact in both; so a ratio of the dimensions counted at these costs is that share of the latents' bytes at
    `length`. None (every layer alike) without sliding layers."""
    if "sliding_attention" not in layer_types:
        return None
    full = max(length - exact, 1)
    held = max(min(window - 1, length) - exact, 1)
    return tuple(held / full if kind == "sliding_attention" else 1.0 for kind in layer_types)


def allocate_ranks_by_error(curves: list[tuple[list[float], list[float]]], ratio: float, step: int, max_rank: int,
                            width: int, floored: tuple[bool, ...] | None = None,
                            curve_step: int = 8, costs: tuple[float, ...] | None = None,
                            kinds: tuple[int, ...] = (0, 1)) -> list[tuple[int, int]]:
    """Per-layer (key rank, value rank) keeping `ratio` of all layers' dimensions, in steps of `step`, chosen to
    lower the sum over layers of the calibrated attention-output errors (`calibration.error_curves`: per layer and
    kind, the error at ranks 0, curve_step, 2 curve_step, ... up to `max_rank`; `width`: KV heads x head_dim) the
    most.

    Greedy: each next step goes to the (layer, kind) whose error falls most per step there; an error curve that
    flattens and then falls again (a few large components late) is looked at over every later step, so a long run of
    small gains does not hide it. Bounds as `allocate_ranks` (at least one step, at most `max_rank`, `floored`
    layers at least `ratio` of each kind); with `costs`, `ratio` counts each layer's dimensions at its cost and the
    error's fall is taken per cost; `kinds` as `allocate_ranks`'."""
    if step % curve_step:
        raise ValueError(f"step must be a multiple of the error curves' step ({curve_step}), got {step}")
    steps = width // step
    cost = costs if costs is not None else (1.0,) * len(curves)
    floor = min(max(1, round(ratio * steps)), max_rank // step)
    top = min(steps, max_rank // step)
    lowest = [floor if floored is not None and floored[layer] else 1 for layer in range(len(curves))]
    ranks = [[low, low] for low in lowest]
    budget = _step_budget(ratio, steps, cost, len(kinds)) \
        - sum(len(kinds) * low * cost[layer] for layer, low in enumerate(lowest))
    every = step // curve_step
    while budget > _SLACK:
        best: tuple[float, int, int, int] | None = None
        for layer, pair in enumerate(curves):
            fits = int((budget + _SLACK) // cost[layer])  # the steps of this layer the budget still pays for
            for k, curve in enumerate(pair):
                if k not in kinds:
                    continue
                at = ranks[layer][k]
                for more in range(1, min(top - at, fits) + 1):  # the best rate over any run of later steps
                    rate = (curve[at * every] - curve[(at + more) * every]) / (more * cost[layer])
                    if best is None or rate > best[0] + 1e-15:
                        best = (rate, layer, k, more)
        if best is None:
            break
        _, layer, k, more = best
        ranks[layer][k] += more
        budget -= more * cost[layer]
    return [(step * key, step * value) for key, value in ranks]


@dataclass(frozen=True)
class LowRankCodec(ReducingCodec):
    """Stores keys and values as coordinates on calibrated bases (Palu, arXiv:2407.21118; ShadowKV,
    arXiv:2410.21465, projects pre-RoPE keys; Eigen Attention and LoRC choose ranks per layer; MLA trains it in).

    With joint bases (what `hf-kvcompress calibrate` writes and the package ships), a layer's KV heads are
    projected together, keys before RoPE: encoding turns each key back by its position, decoding turns it forward
    again, so the layer tracks each slot's position (`needs_positions`) and eviction may keep any tokens. The KV
    heads of a layer then store one latent per token, so an evicting policy keeps one selection per layer (its
    scores averaged over the heads, as for `shared_heads`). With per-head bases (`calibration.calibrate`), keys are
    projected as the cache receives them, after RoPE.

    Args:
        rank: coordinates per KV head in every layer (< head_dim; a joint basis keeps rank x KV heads per layer).
        ratio: the share of all layers' key and value dimensions kept, spread over the layers and kinds by
            `allocate` (joint bases only). On a model with sliding-window layers each layer's dimensions count at
            the tokens they are stored for at `length` (a sliding layer's window, a full-attention layer's every
            token, less the exact window and sinks; `layer_costs`), so that the ratio is the share of the latents'
            bytes there rather than of the dimensions. A ratio beyond what the bases hold (their components per
            layer, in the ratio's whole steps) is refused, naming the most they hold. Neither: ratio 0.25 (joint
            bases) or rank head_dim // 4.
        bases: a directory (or file) written by `hf-kvcompress calibrate`; None: the bases shipped for the model.
        allocate: with `ratio`, how the dimensions are spread over layers and kinds: "error" spends each next step
            where it lowers the calibrated attention-output error most (summed over layers; the curves
            `hf-kvcompress calibrate` writes beside the bases), "copy" as "error" with each layer's curves
            multiplied by its copy weight (`calibrate --copy-weights`: what the layer's errors cost the model's
            copy of a text it has just read, copy_weights.py), "variance" by the share of variance each step
            holds; None: on a model with sliding-window layers "copy" when the bases hold copy weights; otherwise
            below half of the dimensions "copy" when the bases hold copy weights, else "error" when they hold error
            curves, and "variance" from a half on or without curves (chosen on the development halves: on SmolLM2 at
            a quarter the error allocation answered more than variance, and the copy weights more than the plain
            errors; at a half without a window error lost answers that variance kept; on Gemma-3, with the bytes
            counted per layer, copy answered more than error at a quarter and more than variance at a half;
            docs/results.md, "Low rank at a quarter" and "Low rank on Gemma-3 by bytes").
        floor: with `ratio`, "full" (the default): in a model with sliding-window layers, each full-attention layer
            (the layers that read the whole document) keeps at least `ratio` of its key and of its value dimensions,
            the rest allocated by `allocate`; "none": every layer by `allocate` alone. The default was chosen on the
            development half: by variance alone Gemma-3's full-attention layers, whose pre-RoPE key spectra are the
            steepest, fall below the ratio and lose the document's facts. A model without sliding-window layers is
            the same either way; with `rank` every layer has that rank.
        sink_tokens: the first real tokens of each row (padding excluded) that the cache keeps exact beside the
            store, bypassing the bases and the storage (caches/codec_sinks.py): the attention sinks' keys are the
            states the bases, fitted to typical tokens, reconstruct worst. With a storage that has sinks of its own
            (`+int4`), the most either asks for; 0: none.
        residual_length: the newest tokens kept exact in the cache's full-precision tail before they are projected
            (a window, as int4's residual: the question's and the answer's own tokens read exactly), counted in the
            cache's bytes as full-precision tokens; with a storage that has a residual of its own (`+int4`), the
            most either asks for (`exact_residual`), of which the storage's beyond this window holds latents at full
            precision, not whole vectors (`residual_codec`); 0: none. None (the default): 128 when fewer than half of
            the dimensions are kept (a ratio below 0.5, the default ratio included), else 0 alone and 32 beside a
            storage with a residual (`+int4`; at most that residual; with `rank` likewise).
        length: on a model with sliding-window layers, the prompt tokens at which `ratio` is a share of the
            latents' bytes (2,000, the suite's prompts); at longer prompts the full-attention layers' share of the
            bytes weighs more. Ignored without sliding-window layers (every layer holds every token).
        storage: how the coordinates are stored (`lowrank+int4` quantizes them). Under a ratio from a half on, a
            spec's `int4` keeps 32 newest tokens at full precision instead of 128 where it does not name its
            `residual_length` (INT4_IN_STACK, `storage_defaults`): `lowrank:ratio=0.5+int4` stores in
            `int4:residual_length=32`. A ratio's ranks are whole groups: int4's groups along the channels
            (`channel_step`: its value groups) must divide each layer's latent width.
        compute: the dtype a decode step rebuilds the keys in from their latents (joint bases; the products that
            dominate a step at long contexts): "bfloat16" rounds the bases and latents to bf16 for the product (the
            sums stay float32; the C++ kernel of a CPU decode step keeps them so, PyTorch's product returns its keys
            rounded to bf16 once more; the turn and the query's product stay float32), "float32" does not,
            "auto" (the default) takes bf16 on a CPU that multiplies it natively (`ops.bf16_matmul`: measured once
            per process, `HF_KVCOMPRESS_BF16_MATMUL` forces it) and float32 elsewhere (a GPU). A bf16 key differs
            from the float32 one by ~2^-9 of its size, far below the bases' own reconstruction error
            (tests/codecs/test_lowrank_attention.py). What is stored follows: a float32 model whose step computes
            in bf16 stores its key and value latents in bf16 (half the bytes, and half the memory a step reads;
            `latent_dtype`), one that computes in float32 stores float32; a bf16 or float16 model stores its own
            dtype either way, and `+int4` its codes.
        kinds: what is projected: "both" (the default) keys and values; "keys" the keys only (ShadowKV's split:
            pre-RoPE keys are low rank, values often are not), the values handed whole to the storage (exact
            alone, as `+int4` / `+int8` store them in a stack: a token's value is the layer's KV heads concatenated,
            [B, 1, T, H_kv * D], the latent of an identity basis, so every joint path reads it unchanged). `ratio` is
            then the share of the key dimensions kept (at each layer's cost on a model with sliding-window layers),
            allocated over the keys alone by `allocate` on the shipped key curves; `rank` is the keys'. The spec's
            bytes follow from the values' storage and are measured, not implied by `ratio`. Joint bases only. The
            windows (`residual_length`) and `+int4`'s default residual follow `ratio` as for "both".
    """

    name: ClassVar[str] = "lowrank"
    keeps_rope: ClassVar[bool] = False  # coordinates on a basis: the storage cannot undo RoPE on them (pre_rope)
    layer_kernel: ClassVar[bool] = True  # a CPU decode step's layer in one C++ call (`attend_layer`)
    holds_reduced_residual: ClassVar[bool] = True  # `+int4`'s residual holds latents (ReducingCodec.residual_codec)

    rank: int | None = None
    ratio: float | None = None
    bases: str | None = None
    floor: str = "full"
    allocate: str | None = None
    sink_tokens: int = 4  # type: ignore[misc]  # a field here: lowrank's own (the base's property reads the storage's)
    residual_length: int | None = None  # type: ignore[assignment,misc]  # as sink_tokens: lowrank's own (stack: the most)
    length: int = BYTES_AT_LENGTH
    compute: str = "auto"
    kinds: str = "both"
    _tensors: dict | None = field(default=None, init=False, repr=False, compare=False)
    # Bound to the model: whether the bases are joint (keys pre-RoPE), each layer's (key, value) ranks, its RoPE
    # frequencies (joint only) and the model's KV-head count.
    _joint: bool = field(default=False, init=False, repr=False, compare=False)
    _ranks: tuple[tuple[int, int], ...] | None = field(default=None, init=False, repr=False, compare=False)
    _inv_freqs: tuple[tuple[float, ...], ...] | None = field(default=None, init=False, repr=False, compare=False)
    _kv_heads: int = field(default=1, init=False, repr=False, compare=False)
    _encoders: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)  # kinds with oblique bases
    _layer: LayerBases | None = field(default=None, init=False, repr=False, compare=False)
    _layer_idx: int | None = field(default=None, init=False, repr=False, compare=False)
    # One per bound codec, shared by its layers' copies (`for_layer`): the step's cos/sin tables (transient).
    _turns: TurnTables | None = field(default=None, init=False, repr=False, compare=False)
    # The device the layer stores on (`for_device`): what `compute="auto"` resolves to there sets the latents' dtype.
    _device: torch.device | None = field(default=None, init=False, repr=False, compare=False)
    # The reduction alone as a stack's residual holds its latents (`residual_codec`): in the model's dtype, as the
    # stack hands them to its storage, so the storage's codes do not depend on `compute` (`latent_dtype`).
    _holds_for_storage: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1):
            raise ValueError(
                f"rank must be a positive integer below head_dim, or None (head_dim // 4), got {self.rank!r}"
            )
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
                raise ValueError(f"ratio must be a number in (0, 1] (the share of dimensions kept), got {self.ratio!r}")
            if self.rank is not None:
                raise ValueError("give rank or ratio, not both")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(
                f"sink_tokens must be an integer >= 0 (the first real tokens kept exact), got {self.sink_tokens!r}"
            )
        if self.allocate is not None:
            if self.allocate not in ALLOCATIONS:
                raise ValueError(f"allocate must be one of {', '.join(ALLOCATIONS)}, got {self.allocate!r}")
            if self.rank is not None:
                raise ValueError("allocate spreads a ratio's dimensions: give it with ratio, not rank")
        if self.floor is None:  # a spec's `floor=none` reads as None
            object.__setattr__(self, "floor", "none")
        if self.floor not in FLOORS:
            raise ValueError(f"floor must be one of {', '.join(FLOORS)}, got {self.floor!r}")
        if self.compute not in COMPUTE_DTYPES:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute!r}")
        if self.kinds not in PROJECTED_KINDS:
            raise ValueError(f"kinds must be one of {', '.join(PROJECTED_KINDS)}, got {self.kinds!r}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length must be a positive integer (the prompt tokens a hybrid model's ratio counts "
                             f"bytes at), got {self.length!r}")
        if self.residual_length is None:
            share = self.ratio if self.ratio is not None else (DEFAULT_RATIO if self.rank is None else 1.0)
            stacked = 0 if self.storage.lossless else min(WINDOW_IN_STACK, self.storage.exact_residual)
            object.__setattr__(self, "residual_length", WINDOW_BELOW_HALF if share < 0.5 else stacked)
        if isinstance(self.residual_length, bool) or not isinstance(self.residual_length, int) \
                or self.residual_length < 0:
            raise ValueError(
                f"residual_length must be an integer >= 0 (the newest tokens kept exact), got {self.residual_length!r}"
            )

    @classmethod
    def storage_defaults(cls, arguments: dict, storage: str) -> dict:
        """`int4` under a ratio from a half on: INT4_IN_STACK (its residual, where the spec does not name it).
        Elsewhere (below a half, `rank=`, other storages) the storage's own defaults: not measured there."""
        ratio = arguments.get("ratio")
        if storage != "int4" or isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio < 0.5:
            return {}
        return dict(INT4_IN_STACK)

    # -- binding --------------------------------------------------------------------------------------------------

    @property
    def own_residual(self) -> int:
        """lowrank's own window (`residual_length`): whole vectors; the storage's residual beyond it holds latents."""
        assert self.residual_length is not None  # settled in __post_init__
        return self.residual_length

    @property
    def residual_codec(self) -> LowRankCodec | None:
        held = super().residual_codec
        if held is None:
            return None
        assert isinstance(held, LowRankCodec)  # a copy of self (`with_storage`)
        object.__setattr__(held, "_holds_for_storage", True)
        return held

    @property
    def needs_positions(self) -> bool:  # type: ignore[override]
        return self._joint

    @property
    def heads_per_store(self) -> int:  # type: ignore[override]
        return self._kv_heads if self._joint else 1

    @property
    def layer_ranks(self) -> tuple[tuple[int, int], ...] | None:
        """Every layer's (key rank, value rank) as bound to the model (`reduction_for_model`; a joint rank counts
        the layer's KV heads together); None before binding."""
        return self._ranks

    def reduction_for_model(self, config) -> LowRankCodec:
        """Load and check the bases for this model; settle each layer's ranks."""
        tensors, meta = load_bases(self.bases, config)
        head_dim, max_rank, heads = int(meta["head_dim"]), int(meta["max_rank"]), int(meta["kv_heads"])
        joint = meta.get("heads") == JOINT
        if not joint and self.ratio is not None:
            raise ValueError(
                "ratio needs joint bases (one per layer over its KV heads, keys before RoPE), which `hf-kvcompress "
                "calibrate` writes; these hold one basis per head: give rank="
            )
        layers = int(meta["layers"])
        if not joint and self.kinds != "both":
            raise ValueError(f"kinds={self.kinds} needs joint bases (keys projected before RoPE), which `hf-kvcompress "
                             "calibrate` writes; these hold one basis per head: give kinds=both")
        allocated = (0, 1) if self.kinds == "both" else (0,)  # the kinds a ratio's dimensions go to
        if joint:
            if self.rank is not None:
                if self.rank >= head_dim:
                    raise ValueError(f"rank must be below head_dim ({head_dim}), got {self.rank}")
                ranks = [(self.rank * heads, self.rank * heads)] * layers
            else:
                ratio = self.ratio if self.ratio is not None else DEFAULT_RATIO
                step, floored = self._rank_step(heads * head_dim), self._floored(config)
                costs = self._costs(config)
                self._check_ratio_fits(ratio, heads * head_dim, step, max_rank, layers, costs, len(allocated))
                allocate = self.allocate or self._default_allocation(ratio, tensors, costs is not None)
                if allocate in ("error", "copy"):
                    if not has_error_curves(tensors):
                        raise ValueError(f"allocate={allocate} needs bases with attention-error curves (hf-kvcompress "
                                         "calibrate writes them; --attention-errors adds them): give allocate=variance")
                    if allocate == "copy" and not has_copy_weights(tensors):
                        raise ValueError("allocate=copy needs bases with copy weights (hf-kvcompress calibrate "
                                         "--copy-weights adds them): give allocate=error")
                    # "copy": each layer's curves scaled by what its errors cost a copy of the text (its weight).
                    weights = [float(tensors[f"layers.{i}.copy_weight"]) if allocate == "copy" else 1.0
                               for i in range(layers)]
                    curves = [([w * e for e in tensors[f"layers.{i}.key_error"].tolist()],
                               [w * e for e in tensors[f"layers.{i}.value_error"].tolist()])
                              for i, w in enumerate(weights)]
                    ranks = allocate_ranks_by_error(curves, ratio, step, max_rank, heads * head_dim, floored,
                                                    ERROR_STEP, costs, allocated)
                else:
                    variances = [(tensors[f"layers.{i}.key_variance"], tensors[f"layers.{i}.value_variance"])
                                 for i in range(layers)]
                    ranks = allocate_ranks(variances, ratio, step, max_rank, floored, costs, allocated)
            if self.kinds == "keys":  # the values' latents are the layer's heads concatenated (`LayerBases`)
                ranks = [(key, heads * head_dim) for key, _ in ranks]
        else:
            rank = self.rank if self.rank is not None else head_dim // 4
            ranks = [(rank, rank)] * layers
        most = max(pair[k] for pair in ranks for k in allocated)
        if most > max_rank:
            unit = " x KV heads" if joint else ""
            raise ValueError(f"rank{unit} must be at most {max_rank} (the components these bases hold), got {most}")
        bound = replace(self, rank=None if joint and self.rank is None else (self.rank or ranks[0][0]))
        encoders = tuple(kind for k, kind in enumerate(("key", "value"))
                         if joint and k in allocated and f"layers.0.{kind}_encoder" in tensors)
        for name, value in (("_tensors", tensors), ("_joint", joint), ("_ranks", tuple(ranks)), ("_kv_heads", heads),
                            ("_inv_freqs", rope_frequencies(config) if joint else None), ("_encoders", encoders),
                            ("_turns", TurnTables() if joint else None)):
            object.__setattr__(bound, name, value)
        return bound

    def _check_ratio_fits(self, ratio: float, width: int, step: int, max_rank: int, layers: int,
                          costs: tuple[float, ...] | None, kinds: int) -> None:
        """Refuse a ratio the bases cannot hold: each layer keeps at most `max_rank` components (the bases'), in whole
        steps of `step`, so a larger ratio would keep less than it names (no silent cap)."""
        steps = width // step
        cap = min(steps, max_rank // step)  # the steps per layer and kind the bases hold
        unit = (1.0,) * layers if costs is None else costs
        if _step_budget(ratio, steps, unit, kinds) > cap * kinds * sum(unit) + _SLACK:
            most = cap / steps
            what = "the key dimensions (kinds=keys)" if kinds == 1 else "the key and value dimensions"
            raise ValueError(
                f"ratio={ratio:g} asks for more of {what} than these bases hold: at most {most:.4g} ({cap * step} of "
                f"{width} per layer: the bases keep {max_rank} components, and the ratio's ranks are whole steps of "
                f"{step}); give ratio <= {math.floor(most * 1e4) / 1e4:g}, or bases calibrated with a larger "
                "--max-rank (hf-kvcompress calibrate)")

    @staticmethod
    def _default_allocation(ratio: float, tensors: dict, hybrid: bool) -> str:
        """"copy" when the bases hold copy weights and the model has sliding-window layers (its ratio counts bytes,
        `layer_costs`, so the weights' dimensions in the full-attention layers are paid for at their tokens);
        otherwise below half of the dimensions "copy" when the bases hold copy weights, else "error" when they hold
        error curves, and "variance" from a half on or without curves (see `allocate`)."""
        if hybrid and has_copy_weights(tensors):
            return "copy"
        if ratio >= 0.5:
            return "variance"
        if has_copy_weights(tensors):
            return "copy"
        return "error" if has_error_curves(tensors) else "variance"

    @staticmethod
    def _hybrid(config) -> bool:
        """Whether the model mixes sliding-window and full-attention layers."""
        return "sliding_attention" in (getattr(text_config(config), "layer_types", None) or ())

    def _costs(self, config) -> tuple[float, ...] | None:
        """Each layer's cost of a dimension on a model with sliding-window layers (`layer_costs` at `length`, less
        the tokens the stack keeps exact); None otherwise."""
        if not self._hybrid(config):
            return None
        decoder = text_config(config)
        return layer_costs(list(decoder.layer_types), int(decoder.sliding_window), self.length,
                           self.exact_residual + self.exact_sinks)

    def _floored(self, config) -> tuple[bool, ...] | None:
        """The layers `floor` keeps at least the ratio in: a hybrid model's full-attention layers (none otherwise)."""
        if self.floor == "none" or not self._hybrid(config):  # only a ratio's allocation asks (rank=: that rank)
            return None
        return tuple(kind != "sliding_attention" for kind in text_config(config).layer_types)

    def _rank_step(self, width: int) -> int:
        """The granularity of a joint layer's rank: the storage's groups along the channels must divide it (int4's
        value groups, and its key groups unless keys are grouped per channel: `channel_step`), and a ratio's ranks
        are whole steps of the layer's latent width (KV heads x head_dim)."""
        step = getattr(self.storage, "channel_step", None)
        if step is None:  # nothing groups the latents: steps of 8 where the width allows
            return math.gcd(width, 8)
        if width % step:
            fits = [g for g in (8, 16, 32, 64, 128) if width % g == 0]
            named = "group_size" if step == getattr(self.storage, "group_size", None) else \
                "value_group_size (with group_size where keys are grouped per token)"
            raise ValueError(f"{named} of the storage ({self.storage.spec()}) must divide the latent width of a "
                             f"layer (KV heads x head_dim = {width}) for lowrank's ratio to keep whole groups: "
                             f"allowed {', '.join(map(str, fits))} (any divisor of {width}), got {step}")
        return step

    def for_layer(self, layer_idx: int) -> LowRankCodec:
        if self._tensors is None:
            raise ValueError("lowrank needs the model's config to load its bases (make_cache(spec, model.config))")
        # The copy keeps the layer's bases only, not every layer's; the storage is bound to the layer too.
        bound = copy.copy(self)  # keeps what binding set (init=False fields), as `with_storage` does
        assert self._ranks is not None  # settled with the bases (`reduction_for_model`)
        object.__setattr__(bound, "storage", self.storage.for_layer(layer_idx))
        inv_freq = self._inv_freqs[layer_idx] if self._inv_freqs is not None else ()
        object.__setattr__(bound, "_layer", LayerBases(self._tensors, layer_idx, self._ranks[layer_idx], self._joint,
                                                       inv_freq, self.kinds == "keys"))
        object.__setattr__(bound, "_layer_idx", layer_idx)
        if self._turns is not None:
            self._turns.register(layer_idx)
        object.__setattr__(bound, "_tensors", None)
        return bound

    def for_device(self, device: torch.device) -> LowRankCodec:
        bound = copy.copy(self.with_storage(self.storage.for_device(device)))  # keeps the init=False fields
        assert isinstance(bound, LowRankCodec)  # a copy of self
        object.__setattr__(bound, "_device", torch.device(device.type))
        return bound

    def latent_dtype(self, dtype: torch.dtype, kind: Kind) -> torch.dtype:
        """The dtype `kind`'s latents are stored in for a model running in `dtype`: bf16 for a float32 model whose
        decode step computes in bf16 (`compute`, resolved on the device the layer is bound to, `for_device`; not
        bound, "auto" stands for float32, as on a GPU), with joint bases and the latents stored as they are (no
        `+int4`, nor the latents a stack's residual holds for its storage, `residual_codec`), since those products
        round the latents to bf16 anyway; otherwise the model's own dtype."""
        if dtype != torch.float32 or not self._joint or not self.storage.lossless or kind not in BF16_LATENTS \
                or self._holds_for_storage or self._whole(kind):
            return dtype
        if self.compute == "bfloat16" or (self.compute == "auto" and self._device is not None
                                          and fast_bfloat16_matmul(self._device)):
            return torch.bfloat16
        return dtype

    def as_stored(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> Encoded:
        """Latents saved in another dtype than this device stores them in (a cache saved where bf16 products ran,
        loaded where they do not, or the reverse) are converted once, so the store holds what `bytes_per_token`
        promises."""
        if not self._joint or not self.storage.lossless:
            return encoded
        want = self.latent_dtype(dtype, kind)
        return {name: t.to(want) if t.is_floating_point() else t for name, t in encoded.items()}

    def model_bytes(self, layers: int | None = None) -> int:
        """Bytes of the bases every cache of the model reads (means and bases of keys and values, and the encoders of
        oblique ones, float32 as held), counted once per model, not per cache: `measured_kv_bytes` does not count
        them."""
        if self._ranks is None:
            raise ValueError("lowrank counts its bases once bound to a model (make_cache(spec, model.config))")
        head_dim = int(self._head_shape()[1])
        width = self._kv_heads * head_dim
        ranks = self._ranks if layers is None else self._ranks[:layers]
        return sum(4 * width * (r + 1 + (r if kind in self._encoders else 0))
                   for pair in ranks for kind, r in zip(("key", "value"), pair, strict=True))

    def _head_shape(self) -> tuple[int, int]:
        if self._layer is not None:
            mean = self._layer.key_mean
        else:
            assert self._tensors is not None  # bound to a model (checked by the callers)
            mean = self._tensors["layers.0.key_mean"]
        heads, dim = mean.shape
        return int(heads), int(dim)

    # -- encoding ---------------------------------------------------------------------------------------------------

    def _bases(self, kind: Kind, heads: int, device: torch.device,
               part: str = "basis") -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, basis) of `kind` on `device`: the basis latents are rebuilt with, or with part="encoder" the one
        states are projected with (the same tensor unless the bases are oblique)."""
        if self._layer is None:
            raise ValueError("lowrank runs per decoder layer: build the cache with config=model.config")
        layer = self._layer.on(device)
        mean, basis = getattr(layer, f"{kind}_mean"), getattr(layer, f"{kind}_{part}")
        if basis.shape[0] != heads:
            raise ValueError(f"the bases hold {basis.shape[0]} KV heads, the states have {heads}")
        return mean, basis

    def check_head_dim(self, head_dim: int) -> None:
        if self.rank is not None and self.rank >= head_dim:
            raise ValueError(f"rank must be below head_dim ({head_dim}), got {self.rank}")
        if self._ranks is not None and self._joint:
            for pair in (self._ranks if self._layer_idx is None else [self._ranks[self._layer_idx]]):
                for rank in pair:
                    self.storage.check_head_dim(rank)
            return
        super().check_head_dim(head_dim)

    def _whole(self, kind: Kind) -> bool:
        """Whether `kind` is stored whole (`kinds="keys"`: the values), its latent the layer's heads concatenated."""
        return kind == "value" and self.kinds == "keys"

    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor:
        if self._whole(kind):  # [B, H, T, D] -> [B, 1, T, H * D]: the identity basis's latent, without its product
            batch, heads, tokens, dim = states.shape
            return states.transpose(1, 2).reshape(batch, 1, tokens, heads * dim)
        mean, basis = self._bases(kind, states.shape[1], states.device, "encoder")
        centered = states.float() - mean[None, :, None, :]
        if self._joint:  # [B, 1, T, r]: one latent per token for all of the layer's KV heads
            # One [B * T, H * D] x [H * D, r] product (a decode step's token: einsum's planning cost several times it).
            batch, heads, tokens, dim = centered.shape
            flat = centered.transpose(1, 2).reshape(batch * tokens, heads * dim)
            latent = torch.mm(flat, basis.reshape(heads * dim, -1))
            return latent.view(batch, 1, tokens, -1).to(states.dtype)
        return torch.einsum("bhtd,hdr->bhtr", centered, basis).to(states.dtype)

    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        if self._whole(kind):  # `reduce`'s inverse
            batch, _, tokens, width = reduced.shape
            return reduced.reshape(batch, tokens, self._kv_heads, width // self._kv_heads).transpose(1, 2).to(dtype)
        heads = self._kv_heads if self._joint else reduced.shape[1]
        mean, basis = self._bases(kind, heads, reduced.device)
        if self._joint:
            return (torch.einsum("btr,hdr->bhtd", reduced[:, 0].float(), basis) + mean[None, :, None, :]).to(dtype)
        return (torch.einsum("bhtr,hdr->bhtd", reduced.float(), basis) + mean[None, :, None, :]).to(dtype)

    def _inv_freq(self) -> torch.Tensor:
        # Joint bases only, and the codec runs per layer (`for_layer`): the layer's frequencies, where its bases are.
        assert self._joint and self._layer is not None
        return self._layer.inv_freq

    def encode(self, states: torch.Tensor, kind: Kind, positions: torch.Tensor | None = None) -> Encoded:
        """`positions` [B, H_kv, T]: the position each key was rotated to (joint bases: keys are projected with
        RoPE undone)."""
        dtype = self.latent_dtype(states.dtype, kind)  # as bytes_per_token says
        latent = self._encode_in_kernel(states, kind, positions)
        if latent is None:
            if self._joint and kind == "key":
                states = rerotate(states.float(), -self._positions(positions, states), self._inv_freq())
            latent = self.reduce(states, kind)
        return self.storage.encode(latent.to(dtype), kind)

    def _encode_in_kernel(self, states: torch.Tensor, kind: Kind,
                          positions: torch.Tensor | None) -> torch.Tensor | None:
        """Joint bases, at most ENCODE_KERNEL_TOKENS tokens on CPU and the C++ kernel built: the latents [B, 1, n, r]
        float32 in one call (`cpu_decode.lowrank_encode`) instead of `rerotate`'s and `reduce`'s dozen tensor ops:
        the same turn table and the same float32 roundings of the turn and the mean, the projection's sums in another
        order. None otherwise (the PyTorch path, the reference)."""
        if not (self._joint and states.device.type == "cpu" and states.shape[2] <= ENCODE_KERNEL_TOKENS
                and cpu_decode.available()) or self._whole(kind):
            return None
        mean, encoder = self._bases(kind, states.shape[1], states.device, "encoder")
        cos = sin = None
        if kind == "key":  # RoPE undone: the turn by minus each key's position, as `rerotate` turns it
            cos, sin = rope_turns(-self._positions(positions, states), self._inv_freq())
        return cpu_decode.lowrank_encode(states, cos, sin, mean, encoder)

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype, positions: torch.Tensor | None = None):
        if self._joint and kind == "key":
            unrotated = self.expand(self.storage.decode(encoded, kind, torch.float32), kind, torch.float32)
            return rerotate(unrotated, self._positions(positions, unrotated), self._inv_freq()).to(dtype)
        return self.expand(self.storage.decode(encoded, kind, dtype), kind, dtype)

    # -- attention over the latents (caches/store_attention.py) ------------------------------------------------------

    @property
    def attends_encoded(self) -> bool:  # type: ignore[override]
        """Joint bases: a decode step reads the store's latents a block at a time instead of decoding every key and
        value of the layer (`key_logits`, `mix_values`): a value is the basis times its latent plus the mean, so
        attention mixes the latents and maps the mix to values once per query; keys, turned by RoPE at their own
        positions, cannot move their basis to the query side (the turn differs per token) and are rebuilt a block
        at a time."""
        return self._joint

    def key_logits(self, encoded: Encoded, query: torch.Tensor, positions: torch.Tensor | None = None,
                   last_block: bool = True) -> torch.Tensor:
        """`positions` [B, H_kv, T]: the position each key was rotated to (joint bases share each slot over the
        layer's KV heads, so every head holds the same positions and the first head's serve all). `last_block`:
        whether this is the last block of the layer's store read this step (the last layer's drops the step's
        cos/sin tables, `TurnTables`)."""
        if not self._joint:
            return super().key_logits(encoded, query)
        compute = self._compute_dtype(query.device)
        latent = self.storage.decode(encoded, "key", compute)  # [B, 1, T, r]
        mean, basis, cos, sin = self._key_inputs(latent, query, positions, last_block)
        heads, dim, rank = basis.shape
        batch, tokens = latent.shape[0], latent.shape[2]
        # The pre-RoPE keys as [B, H, D, T]: one [H * D, r] x [r, B * T] product for the layer's heads and rows,
        # laid out so that (batch 1) each head's keys are the second operand of the query's product as they are.
        flat = latent[:, 0].reshape(batch * tokens, rank)
        if compute == torch.float32:
            keys = torch.mm(basis.reshape(heads * dim, rank), flat.float().t())
        else:
            keys = _product_in_chunks(basis.reshape(heads * dim, rank).to(compute), flat)
        keys = keys.view(heads, dim, batch, tokens).permute(2, 0, 1, 3).add_(mean[None, :, :, None])
        # Rotate-half RoPE (ops/rerotate.py) met by the query half by half: q . turn(k) = q1 . (k1 cos - k2 sin) +
        # q2 . (k2 cos + k1 sin); channels past the rotated ones (partial rotary) meet the query as they are.
        half = cos.shape[2]
        first, second = keys[:, :, :half], keys[:, :, half : 2 * half]
        turned_first = (first * cos).addcmul_(second, sin, value=-1)
        turned_second = (second * cos).addcmul_(first, sin)
        logits = torch.matmul(query[..., :half], turned_first)
        logits += torch.matmul(query[..., half : 2 * half], turned_second)
        if 2 * half < dim:
            logits += torch.matmul(query[..., 2 * half :], keys[:, :, 2 * half :])
        return logits

    def _key_inputs(self, latent: torch.Tensor, query: torch.Tensor, positions: torch.Tensor | None,
                    last_block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a block's key logits read besides its latents [B, 1, T, r]: the key mean [H, D] and basis [H, D, r],
        and the step's cos and sin [B, 1, R / 2, T] at the keys' positions (`TurnTables`; the last block of the bound
        layers drops them)."""
        mean, basis = self._bases("key", query.shape[1], latent.device)
        inv_freq = self._inv_freq()  # on the latents' device with the bases (`_bases`)
        position = self._positions(positions, latent.expand(-1, query.shape[1], -1, -1))[:, :1].to(torch.float32)
        assert self._turns is not None  # bound with the joint bases
        cos, sin = self._turns.lookup(inv_freq, position)  # [B, 1, R / 2, T]
        if last_block and self._layer_idx == self._turns.last_layer:
            self._turns.release()  # the step's last read of the tables (`TurnTables`)
        return mean, basis, cos, sin

    def attend_layer(self, keys: Encoded | None, values: Encoded | None, query: torch.Tensor,
                     bias: torch.Tensor | None, sink_slots: torch.Tensor | None, sink_keys: torch.Tensor | None,
                     sink_values: torch.Tensor | None, tail_keys: torch.Tensor, tail_values: torch.Tensor,
                     positions: torch.Tensor | None = None, held_keys: Encoded | None = None,
                     held_values: Encoded | None = None) -> torch.Tensor | None:
        """Joint bases, a CPU decode step (at most KERNEL_ROWS query rows per KV head) and the C++ kernel built: the
        whole layer in one call (`cpu_decode.lowrank_decode_attention`, which rebuilds, turns and meets the keys and
        mixes the value latents a tile of tokens at a time in registers, meets the exact sinks and the tail in the
        same softmax and maps the mix to values); the same sums as the PyTorch segments over `key_logits` and
        `mix_values` in another order (bf16 products where `compute` asks). The store is read in one call, not in
        blocks: the kernel holds a tile at a time, and the step's cos/sin tables (`TurnTables`, shared by the layers)
        are all it reads beside the store. `positions` as `key_logits`' (the store's slots, then the held ones).
        `held_keys` / `held_values`: the storage's residual as latents (`residual_codec`), read after the store's.

        A storage whose codes the kernel reads where they lie (`plain_codes`: `+int4`'s 4-bit codes, a scale and zero
        per group, its Hadamard rotation) hands the kernel its codes, not the latents decoded for the whole store at
        every step: each tile is decoded in registers to the same numbers, bit for bit. Others (other widths,
        Lloyd-Max levels, pre_rope, a rotated store of at most 16 tokens: `IntNCodec.plain_codes`) are decoded here
        first, as before; the result is the same either way."""
        if not (self._joint and query.device.type == "cpu" and query.shape[2] <= KERNEL_ROWS
                and cpu_decode.available()):
            return None
        compute = self._compute_dtype(query.device)
        codes = self._codes_in_place(keys, values, held_keys, positions, query)
        if codes is None:
            latent = self._latents(keys, held_keys, "key", compute)
            value_latent = self._latents(values, held_values, "value", torch.float32)  # [B, 1, T, r_v]
            slots = latent
        else:  # the kernel reads the store's codes; the latents passed are the held ones (maybe none) after them
            latent = self._held_latents(held_keys, "key", compute, query)
            value_latent = self._held_latents(held_values, "value", torch.float32, query)
            assert positions is not None  # `_codes_in_place` read the store's slots from them
            slots = latent.new_empty(latent.shape[0], 1, positions.shape[-1], 0)  # the shape of every slot's latent
        mean, _, cos, sin = self._key_inputs(slots, query, positions, last_block=True)
        assert self._layer is not None  # bound per layer (`_bases` checked)
        kernel_basis, pairs = self._layer.key_basis_for_kernel(compute)
        value_mean, value_basis = self._bases("value", query.shape[1], query.device)
        return cpu_decode.lowrank_decode_attention(
            latent[:, 0], kernel_basis, pairs, compute == torch.bfloat16, mean, cos[:, 0], sin[:, 0],
            query.float().contiguous(), value_latent[:, 0], value_basis, value_mean, bias, sink_slots,
            sink_keys, sink_values, tail_keys, tail_values, codes=codes)

    def _codes_in_place(self, keys: Encoded | None, values: Encoded | None, held_keys: Encoded | None,
                        positions: torch.Tensor | None, query: torch.Tensor
                        ) -> tuple[Encoded, Encoded, cpu_decode.AffineCodes, cpu_decode.AffineCodes] | None:
        """(key store, value store, their `AffineCodes`) where the storage's codes of both kinds can be read where
        they lie (`plain_codes`), else None."""
        if keys is None or values is None or positions is None:
            return None
        assert self._ranks is not None and self._layer_idx is not None  # joint bases are bound per layer
        key_rank, value_rank = self._ranks[self._layer_idx]
        held = 0 if held_keys is None else IdentityCodec().decode(held_keys, "key", query.dtype).shape[2]
        tokens = positions.shape[-1] - held  # the store's slots (`positions` holds the store's, then the held ones)
        key_codes = self.storage.plain_codes("key", key_rank, tokens, query.device)
        value_codes = self.storage.plain_codes("value", value_rank, tokens, query.device)
        if key_codes is None or value_codes is None:
            return None
        return keys, values, key_codes, value_codes

    def _held_latents(self, held: Encoded | None, kind: Kind, dtype: torch.dtype, query: torch.Tensor) -> torch.Tensor:
        """The held latents [B, 1, Th, r] in `dtype` (as `_latents` converts them), [B, 1, 0, r] without."""
        if held is not None:
            return IdentityCodec().decode(held, kind, dtype).to(dtype)
        assert self._ranks is not None and self._layer_idx is not None  # joint bases are bound per layer
        rank = self._ranks[self._layer_idx][0 if kind == "key" else 1]
        return torch.empty(query.shape[0], 1, 0, rank, dtype=dtype, device=query.device)

    def _latents(self, encoded: Encoded | None, held: Encoded | None, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        """The latents [B, 1, T, r] of the store's slots (`encoded`, decoded by the storage in `dtype`; a stored
        latent of lowrank alone as it is kept) followed by the held ones (`residual_codec`'s latents, in the store's
        dtype; as they are when the store holds none, as lowrank alone keeps them)."""
        held_latent = None if held is None else IdentityCodec().decode(held, kind, dtype)
        if encoded is None:
            assert held_latent is not None  # the caller reads a layer that holds slots
            return held_latent
        latent = self.storage.decode(encoded, kind, dtype)
        if held_latent is None:
            return latent
        return torch.cat([latent, held_latent.to(latent.dtype)], dim=2)

    def decode_in_basis(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        """Joint values: [B, 1, T, r + 1], each token's latent and a 1, the weight of the mean (`from_basis`)."""
        if not self._joint or kind == "key":
            return super().decode_in_basis(encoded, kind, dtype)
        latent = self.storage.decode(encoded, kind, dtype).to(dtype)
        return torch.cat([latent, latent.new_ones(*latent.shape[:-1], 1)], dim=-1)

    def mix_values(self, encoded: Encoded, probs: torch.Tensor) -> torch.Tensor:
        """Joint values: probs [B, H, n, T] times the shared latents [B, 1, T, r], and the probabilities' sum (the
        mean's weight): [B, H, n, r + 1]."""
        if not self._joint:
            return super().mix_values(encoded, probs)
        latent = self.storage.decode(encoded, "value", torch.float32).float()[:, 0]  # [B, T, r]
        batch, heads, queries, tokens = probs.shape
        # One [H * n, T] x [T, r] product per row: a broadcast over the heads would copy the latents per head.
        mixed = torch.matmul(probs.reshape(batch, heads * queries, tokens), latent).view(batch, heads, queries, -1)
        return torch.cat([mixed, probs.sum(-1, keepdim=True)], dim=-1)

    def from_basis(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Joint values: x [B, H, n, r + 1] (mixed latents and their weight) -> the basis times the latents plus the
        weight times the mean, [B, H, n, D]. Linear in x, as the online softmax's rescaling needs."""
        if not self._joint or kind == "key":
            return x
        mean, basis = self._bases(kind, x.shape[1], x.device)
        return torch.matmul(x[..., :-1], basis.transpose(-1, -2)) + x[..., -1:] * mean[None, :, None, :]

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the keys are rebuilt in on `device` (`compute`)."""
        if self.compute == "auto":
            return torch.bfloat16 if fast_bfloat16_matmul(device) else torch.float32
        return getattr(torch, self.compute)

    @staticmethod
    def _positions(positions: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
        if positions is None:
            raise ValueError("lowrank with joint bases stores keys before RoPE: encode and decode need positions=")
        batch, heads, tokens = states.shape[:3]
        if positions.shape == (batch, 1, tokens):  # one position per slot for every head (caches/slot_records.py)
            return positions.expand(batch, heads, tokens)
        if positions.shape != states.shape[:3]:
            raise ValueError(f"positions must be [B, H_kv, T] = {list(states.shape[:3])} (or [B, 1, T]), got "
                             f"{list(positions.shape)}")
        return positions

    def stored_fraction(self, head_dim: int) -> tuple[int, float]:
        if self._joint:
            if self._layer_idx is None:
                raise ValueError("lowrank with joint bases stores a rank per layer: ask the layer's codec (for_layer)")
            assert self._ranks is not None  # settled with the joint bases
            rank = self._ranks[self._layer_idx][0]
            return rank, self._kv_heads
        return (self.rank if self.rank is not None else head_dim // 4), 1

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        if not self._joint:
            return super().bytes_per_token(head_dim, kind, dtype)
        if self._layer_idx is None:
            raise ValueError("lowrank with joint bases stores a rank per layer: ask the layer's codec (for_layer)")
        assert self._ranks is not None  # settled with the joint bases
        rank = self._ranks[self._layer_idx][0 if kind == "key" else 1]
        return self.storage.bytes_per_token(rank, kind, self.latent_dtype(dtype, kind)) / self._kv_heads
