"""The lesson's plans, measured: bytes from the formula beside bytes a real cache held, and accuracy by depth.

The lesson computes each plan's memory and says the quality cost "is not visible here". The study runs every
plan of the registry on long-context recall tasks (question after the document), then turns the measurements
into the lesson's table, its "users per GPU" worked example, and a recommendation for the user's constraints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .budget import GIB, kv_shape_from_config, model_weight_bytes
from .caches.plan import plan_layers, ratio_as_bytes, sliding_kept
from .codecs.fp8 import Fp8Codec
from .codecs.identity import IdentityCodec
from .codecs.intn import IntNCodec
from .codecs.lowrank import LowRankCodec
from .codecs.reducing import ReducingCodec
from .codecs.shared_heads import SharedHeadsCodec
from .eval.report import served_bytes
from .eval.tasks import BANDS
from .hf.compat import text_config
from .policies.block_window import BlockWindowPolicy
from .policies.sink_window import SinkWindowPolicy
from .registry import STUDY_PLANS, parse_spec, study_specs

# Depth bands of the lesson's warning: questions about the start and the middle are where eviction fails.
EMBEDDED_MODELS = ("smollm2-135m", "gemma-3-270m")
# A model whose uncompressed needle score is below this shows no losses worth ranking.
BASELINE_RULE = 70.0


def bytes_per_value(spec: str, model_bytes: float, config=None) -> float:
    """The lesson's `bytes` factor for a plan: the codec's value width, scales and residual not counted.

    Sharing and low rank shrink other factors of the formula (kv_heads, head_dim); they are folded in here as a
    fraction of the full width, so the formula stays `2 x layers x kv_heads x head_dim x bytes x tokens`.
    """
    codec = parse_spec(spec)[1]
    fraction = 1.0
    while isinstance(codec, ReducingCodec):
        if isinstance(codec, SharedHeadsCodec):
            if codec.ratio is not None:  # calibrated maps: `ratio` of all layers' key and value heads stored
                if config is None:
                    fraction *= codec.ratio
                else:  # in whole heads, as `allocate_levels` rounds them
                    shape = kv_shape_from_config(config)
                    units = 2 * shape.layers * shape.kv_heads
                    fraction *= round(codec.ratio * units) / units
            elif codec.heads_per_group is None and config is None:
                raise ValueError(f"{spec!r}: sharing all KV heads needs the model's config for the formula")
            else:
                fraction /= codec.heads_per_group or kv_shape_from_config(config).kv_heads
        elif isinstance(codec, LowRankCodec):
            head_dim = kv_shape_from_config(config).head_dim if config is not None else None
            if codec.ratio is not None:  # the share of all layers' key and value dimensions kept
                fraction *= codec.ratio
            elif codec.rank is None and head_dim is None:
                raise ValueError(f"{spec!r}: lowrank's default rank needs the model's config for the formula")
            else:
                fraction *= (codec.rank or head_dim // 4) / head_dim if head_dim else 1.0
        codec = codec.storage
    if isinstance(codec, IdentityCodec):
        return model_bytes * fraction
    if isinstance(codec, Fp8Codec):
        return 1.0 * fraction
    if isinstance(codec, IntNCodec):
        return codec.bits / 8 * fraction
    raise ValueError(f"no lesson formula for codec {type(codec).__name__} in {spec!r}")


def kept_tokens(policy, tokens: float) -> float:
    """Tokens a full-attention layer keeps per KV head after `tokens`: all of them, a `budget`'s min(budget,
    tokens), or a `ratio`'s share ceil(ratio x tokens) (never fewer than its sinks + recent), as `kept_per_row`."""
    if policy.budget is not None:
        return min(tokens, policy.budget)
    if policy.ratio is not None:
        return min(tokens, max(math.ceil(policy.ratio * tokens), policy.sink_tokens + policy.recent))
    return tokens


def formula_bytes(spec: str, config, tokens: float, model_bytes: float) -> float:
    """The lesson's formula for one user of `tokens`: layers x kv_heads x head_dim x 2 x bytes x tokens kept.

    Each family shrinks its factor and combinations multiply: a codec its bytes (`bytes_per_value`), sharing and low
    rank their share of the width, eviction the tokens (`kept_tokens`: a ratio keeps its share, a budget caps them).
    Sliding-window layers hold at most their window (a ratio keeps its share of it, as `sliding_kept`).
    """
    shape = kv_shape_from_config(config)
    policy = parse_spec(spec)[0]
    per_token = 2 * shape.kv_heads * shape.head_dim * bytes_per_value(spec, model_bytes, config)
    windows = shape.windows or (None,) * shape.layers
    layer_types = getattr(text_config(config), "layer_types", None) or ()
    total = 0.0
    for i, window in enumerate(windows):
        if window == 0:
            continue
        if window is None:
            kept = kept_tokens(policy, tokens)
        else:
            share = sliding_kept(policy, layer_types[i] if i < len(layer_types) else "sliding_attention", window)
            kept = min(tokens, window if share is None else share)
        total += per_token * kept
    return total


def promised_bytes(spec: str, config, tokens: int, model_bytes: float, device: str = "cpu") -> float:
    """What the plan's cache holds for one user after `tokens` tokens, as `CompressedLayer.promised_bytes` counts
    it (codec rates, scales, the full-precision residual and sinks; tokens kept as `kept_tokens`), without running
    the model, with values of `model_bytes` bytes, on a `device` of that kind (a float32 low-rank cache stores bf16
    latents where the device computes its step in bf16, `LowRankCodec.latent_dtype`; at 2 bytes the device does not
    matter); tested against measured (tests/test_study_bytes.py)."""
    policy, codec = parse_spec(spec)
    policy, codec = ratio_as_bytes(policy, codec, config)  # a plain KVzip ratio below a half: its byte target
    share = getattr(policy, "bytes", None)
    if share is not None:
        # KVzip's bytes=: the ranking spends that share of the uncompressed bytes (plan.py `ByteTarget`), but never
        # less than the other layers and the ranked layers' sinks hold (a hybrid model's sliding windows, on a
        # document too short for them to fit in the share), nor more than every pair costs (int4 layers that all fit).
        target = share * promised_bytes("dynamic", config, tokens, model_bytes, device)
        least = _plan_bytes(policy, codec, config, tokens, model_bytes, device, ranked_all=False)
        return min(max(target, least), _plan_bytes(policy, codec, config, tokens, model_bytes, device))
    return _plan_bytes(policy, codec, config, tokens, model_bytes, device)


def _plan_bytes(policy, codec, config, tokens: int, model_bytes: float, device: str,
                ranked_all: bool = True) -> float:
    """`promised_bytes` of `policy` x `codec` by the plan's layers. Under KVzip's `bytes=` the ranked layers keep
    every pair, or with `ranked_all=False` their codec's sinks alone."""
    shape = kv_shape_from_config(config)
    dtype = {4: torch.float32, 2: torch.bfloat16}.get(int(model_bytes), torch.float32)
    windows = shape.windows or (None,) * shape.layers
    # KVzip's head budgets, or KVzap's (`ranks_prompt`): the ranked layers become per-head stores.
    head_store = policy.ranks_prompt or (
        policy.scores_by_reconstruction and getattr(policy, "budgets", None) == "head" and policy.evicts)
    total = 0.0
    # The layers CompressedCache builds.
    for plan, held in zip(plan_layers(policy, codec, config), windows, strict=True):
        if held == 0:  # a layer that stores no keys and values (budget.py: shared or not attention)
            continue
        layer_codec = plan.codec.for_device(torch.device(device))  # as the layer binds it at its first step
        kept: float  # tokens per KV head: whole for a window, a share of them for a ratio (`kept_tokens`)
        if plan.is_sliding:  # a block window or an exact window (plan.py: `sliding_layer_policy`)
            sliding = plan.policy
            if isinstance(sliding, BlockWindowPolicy):
                kept = sliding.held(tokens)
            else:
                assert isinstance(sliding, SinkWindowPolicy) and sliding.window is not None
                kept = min(tokens, sliding.window)
        else:
            kept = kept_tokens(plan.policy, tokens)  # KVzap's planned budget: the layer's (plan.py)
            if plan.byte_target is not None:  # KVzip's bytes=: every pair, or the sinks (`promised_bytes`)
                kept = tokens if ranked_all else min(tokens, 0 if plan.codec.lossless else plan.codec.exact_sinks)
            if plan.sliding_share is not None:  # what the sliding layers gave up (plan.py: `SlidingShare`)
                seen = torch.tensor([round(tokens)])
                kept += int(plan.sliding_share.extra(seen, torch.tensor([round(kept)])))
        if not plan.is_sliding and head_store:
            # KVzip's per-head store (caches/head_store.py): kept pairs encoded, each with its float32
            # score; the codec's sinks exact beside it; one int64 length per head. The kept pairs among the
            # context's newest tokens, which the scored layer still held at full precision (its residual), stay
            # exact in a second store: which pairs those are depends on the scores, so they are counted as the kept
            # share of those slots (an estimate: tests/test_study_bytes.py bounds it).
            sinks = 0 if layer_codec.lossless else min(layer_codec.exact_sinks, kept)
            pair = layer_codec.bytes_per_token(shape.head_dim, "key", dtype) + layer_codec.bytes_per_token(
                shape.head_dim, "value", dtype)
            exact = 0
            if not layer_codec.lossless:
                block = max(layer_codec.token_block("key"), layer_codec.token_block("value"))
                unencoded = tokens - max(0, (tokens - layer_codec.exact_residual) // block * block)
                exact = round((kept - sinks) * unencoded / max(tokens, 1))
            full = 2 * shape.head_dim * model_bytes
            total += shape.kv_heads * ((kept - sinks - exact) * (pair + 4) + exact * (full + 4) + sinks * full + 8)
            total += shape.kv_heads * 8 if exact else 0
            total += sinks
            continue
        encoded: float  # tokens held encoded (`kept` may be a share of a token)
        if layer_codec.lossless:
            encoded = 0
        else:
            block = max(layer_codec.token_block("key"), layer_codec.token_block("value"))
            residual = layer_codec.exact_residual
            encoded = max(0, (kept - residual) // block * block)
        per_encoded = layer_codec.bytes_per_token(shape.head_dim, "key", dtype) + layer_codec.bytes_per_token(
            shape.head_dim, "value", dtype)
        whole = kept - encoded
        residual_codec = layer_codec.residual_codec  # None unless a stack holds its residual reduced
        if residual_codec is not None:  # a stack holds its storage's residual reduced, beyond its own window
            whole = min(whole, layer_codec.whole_residual)
            per_held = residual_codec.bytes_per_token(shape.head_dim, "key", dtype) + residual_codec.bytes_per_token(
                shape.head_dim, "value", dtype)
            total += shape.kv_heads * (kept - encoded - whole) * per_held
        total += shape.kv_heads * (encoded * per_encoded + whole * 2 * shape.head_dim * model_bytes)
        scored = policy.needs_attention or policy.scores_by_reconstruction or policy.needs_hidden_states
        if not plan.is_sliding and policy.evicts and scored:
            total += shape.kv_heads * kept * 4  # each kept slot's float32 score (H2O's sums, KVzip's maxima, KVzap's)
        if layer_codec.needs_positions:  # each slot's int32 key position (lowrank's joint bases decode at it)
            # one for every head until an eviction keeps slots per head (caches/slot_records.py; a block window
            # drops the oldest slots of every head alike), or where the policy reads them per head
            evicted = kept < tokens and not isinstance(plan.policy, BlockWindowPolicy)
            per_head = evicted or plan.policy.needs_positions
            total += (shape.kv_heads if per_head else 1) * kept * 4
        if layer_codec.exact_sinks and (encoded > 0 or kept < tokens):
            # full-precision sinks, copied at the first encoding or eviction: keys, values and an int64 slot each
            total += shape.kv_heads * layer_codec.exact_sinks * (2 * shape.head_dim * model_bytes + 8)
    return total


Z95 = 1.959964  # two-sided 95% normal quantile


def wilson(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of a proportion, in percent; (nan, nan) without samples."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def bootstrap_mean(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of a mean (scores can be partial, so not a proportion)."""
    if not values:
        return float("nan"), float("nan")
    x = torch.tensor(values, dtype=torch.float64)
    if bool((x == x[0]).all()):
        if x[0] in (0.0, 100.0):  # all right or all wrong: the bootstrap says nothing, Wilson does
            return wilson(int(x[0] == 100.0) * len(values), len(values))
        return float(x[0]), float(x[0])
    g = torch.Generator().manual_seed(seed)
    means = x[torch.randint(len(values), (draws, len(values)), generator=g)].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


@dataclass
class PlanResult:
    spec: str
    formula_bytes: float  # at the study's document length
    measured_bytes: float  # after the document, mean over samples
    factor: float  # dynamic's measured bytes / this plan's
    bands: dict[str, float]  # depth band -> mean score
    score: float
    delta: float  # score - dynamic's score
    bytes_per_user: float  # at --context, as the method's cache would hold it (`promised_bytes`)
    users: int
    n: int = 0  # scored samples
    band_ci: dict[str, tuple[float, float]] | None = None  # 95% intervals of the band scores ("all" included)
    band_n: dict[str, int] | None = None
    retention: float = float("nan")  # % of the samples the baseline answers that this plan still answers
    retention_ci: tuple[float, float] = (float("nan"), float("nan"))
    scores: dict[str, float] | None = None  # sample_id -> score, for paired comparisons
    # kept share of the tokens at --context (users per GPU) below the share its score was measured at: a budget
    # or window keeps the same tokens of a longer context, so the score does not carry over to those users
    stretched: bool = False


@dataclass(frozen=True)
class LessonRow:
    """A row of the lesson's table (lesson_table.py builds them) as the study's results file keeps it."""

    lesson: str  # the lesson's row
    lesson_factor: float  # how many times smaller at the lesson's 8B shape, 32k tokens
    result: PlanResult | None  # the study's plan standing for it, None when no plan of the study matches
    formula_factor: float = float("nan")  # the uncompressed formula's bytes / this plan's, on the studied model


def depth_bands(records: list[dict]) -> dict[str, float]:
    out = {}
    for name, low, high in BANDS:
        scores = [r["score"] for r in records if low <= r["depth"] < high]
        out[name] = sum(scores) / len(scores) if scores else float("nan")
    return out


def band_intervals(records: list[dict]) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
    cis, counts = {}, {}
    for name, low, high in (*BANDS, ("all", -1, 1000)):
        scores = [r["score"] for r in records if low <= r["depth"] < high]
        cis[name], counts[name] = bootstrap_mean(scores), len(scores)
    return cis, counts


def retention(rows: list[dict], base_rows: list[dict]) -> tuple[float, tuple[float, float], int]:
    """Share (%) of the samples the uncompressed cache answers correctly that this plan answers too."""
    answered = {r["sample_id"] for r in base_rows if r["correct"]}
    kept = sum(1 for r in rows if r["sample_id"] in answered and r["correct"])
    n = sum(1 for r in rows if r["sample_id"] in answered)
    return (100 * kept / n if n else float("nan")), wilson(kept, n), n


def analyse(records: list[dict], config, model_bytes: float, weights_bytes: float, gpu_memory: float,
            context: int, reserve: float = 0.0, usable_tasks: set[str] | None = None) -> list[PlanResult]:
    """One PlanResult per method, over the tasks in `usable_tasks` (those the baseline passes).

    Bytes are at the dtype the model is served in (`model_bytes` per value; the records' served bytes): a CPU runs
    the model in float32, but the ratios a user sees are against the 16-bit cache. Users per GPU come from
    `promised_bytes` at `context` tokens, which must not pass the model's max_position_embeddings.
    """
    longest = getattr(text_config(config), "max_position_embeddings", None)
    if longest and context > longest:
        raise ValueError(f"context={context:,} tokens is past this model's max_position_embeddings ({longest:,})")
    if usable_tasks is not None:
        records = [r for r in records if r["task"] in usable_tasks]
    methods = list(dict.fromkeys(r["method"] for r in records))
    free = gpu_memory - weights_bytes - reserve
    by_method = {m: [r for r in records if r["method"] == m] for m in methods}
    base = by_method["dynamic"]
    base_bytes = sum(served_bytes(r, "document") for r in base) / len(base)
    base_score = sum(r["score"] for r in base) / len(base)
    results = []
    for method, rows in by_method.items():
        tokens = sum(r["document_tokens"] for r in rows) / len(rows)
        measured = sum(served_bytes(r, "document") for r in rows) / len(rows)
        formula = formula_bytes(method, config, tokens, model_bytes)
        score = sum(r["score"] for r in rows) / len(rows)
        per_user = promised_bytes(method, config, context, model_bytes)
        users = max(0, math.floor(free / per_user)) if per_user > 0 else 0
        cis, counts = band_intervals(rows)
        kept, kept_ci, _ = retention(rows, base)
        policy = parse_spec(method)[0]
        # a ratio keeps its share at any length (ceil() only rounds it); a budget keeps a smaller share of more
        stretched = policy.budget is not None and (
            kept_tokens(policy, context) / context < 0.99 * kept_tokens(policy, tokens) / tokens)
        results.append(PlanResult(method, formula, measured, base_bytes / measured, depth_bands(rows), score,
                                  score - base_score, per_user, users, len(rows), cis, counts, kept, kept_ci,
                                  {f"{r['task']}/{r['sample_id']}": r["score"] for r in rows}, stretched))
    return results


def paired_difference(a: PlanResult, b: PlanResult) -> tuple[float, float, float]:
    """Mean score difference a - b over the samples both ran, with its 95% bootstrap interval."""
    if a.scores is None or b.scores is None:
        raise ValueError("paired_difference needs each plan's per-sample scores (PlanResult.scores)")
    common = [k for k in a.scores if k in b.scores]
    diffs = [a.scores[k] - b.scores[k] for k in common]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    mean = sum(diffs) / len(diffs)
    if all(d == diffs[0] for d in diffs):
        return mean, mean, mean
    lo, hi = bootstrap_mean(diffs, seed=1)
    return mean, lo, hi


def recommend(results: list[PlanResult], min_quality: float) -> PlanResult:
    """The plan serving the most users among those within `min_quality` points of the baseline whose score holds
    at the users' context (not `stretched`)."""
    eligible = [r for r in results if r.delta >= -min_quality and not r.stretched]
    return max(eligible, key=lambda r: (r.users, r.score, -r.measured_bytes))


def score_cell(value: float, ci: tuple[float, float] | None) -> str:
    if math.isnan(value):
        return f"{'-':>13s}"
    if ci is None or math.isnan(ci[0]):
        return f"{value:5.0f}        "
    return f"{value:5.0f} [{ci[0]:3.0f}-{ci[1]:3.0f}]"


def format_table(results: list[PlanResult], tokens: float, dtype: str = "bfloat16") -> str:
    """The study's table; bytes (MiB per sample after the document) at `dtype`, the dtype the model is served in."""
    n = results[0].band_n or {} if results else {}
    bands = [(name, n.get(name, 0)) for name, _, _ in BANDS]
    lines = [
        f"{'plan':46s} {'formula':>8s} {'measured':>8s} {'x less':>6s} "
        + " ".join(f"{name + ' (' + str(k) + ')':>13s}" for name, k in bands)
        + f" {'all (' + str(results[0].n if results else 0) + ')':>13s} {'retention':>13s}",
        f"{'':46s} {'MiB, ' + format(tokens, '.0f') + ' tok, ' + dtype:>24s}  score, 95% interval "
        "(bootstrap; Wilson when all agree)",
    ]
    for r in results:
        ci = r.band_ci or {}
        cells = " ".join(score_cell(r.bands[name], ci.get(name)) for name, _, _ in BANDS)
        lines.append(
            f"{r.spec:46s} {r.formula_bytes / 2**20:8.2f} {r.measured_bytes / 2**20:8.2f} {r.factor:6.1f} {cells} "
            f"{score_cell(r.score, ci.get('all'))} {score_cell(r.retention, r.retention_ci)}"
        )
    return "\n".join(lines)


def residual_note(spec: str, tokens: float, config=None) -> str | None:
    """What an int codec's full-precision residual covers when `tokens` tokens are kept per layer, else None.

    KIVI keeps the `residual_length` most recent tokens unquantized; when a plan keeps no more than that (short
    prompts, or eviction to a small window) nothing is quantized and the plan costs what it would without it.
    With the model's `config`, the spec is read as the plan runs it (`ratio_as_bytes`): a byte target (KVzip's
    `bytes=`, or a ratio planned as one) holds its share of the bytes with its exact residual paid for inside it, so
    it has no note.
    """
    policy, codec = ratio_as_bytes(*parse_spec(spec), config)
    if getattr(policy, "bytes", None) is not None:
        return None
    residual = getattr(codec, "residual_length", 0)
    if not isinstance(codec, IntNCodec) or residual <= 0:
        return None
    kept = kept_tokens(policy, tokens)
    name = f"int{codec.bits}"
    if kept <= residual:
        return (f"{spec}: keeps {kept:.0f} tokens per layer, all within {name}'s full-precision residual "
                f"(residual_length={residual}): nothing is quantized, so it costs what it would without {name}")
    return (f"{spec}: the {residual} most recent of {kept:.0f} kept tokens stay in full precision "
            f"(residual_length={residual}); the saving approaches what {codec.bits} bits promise only on much longer "
            "prompts")


def residual_notes(results: list[PlanResult], tokens: float, config=None) -> str:
    """The notes of `residual_note` for the table's plans on the model of `config`, one per line (empty if no plan
    quantizes to ints)."""
    notes = [note for note in (residual_note(r.spec, tokens, config) for r in results) if note]
    return "\n".join(["Full-precision residual (why int plans save less than their bits at this length):",
                      *(f"  {n}" for n in notes)]) if notes else ""


def format_users(results: list[PlanResult], min_quality: float, gpu_memory: float, weights: float, context: int,
                 dtype: str = "bfloat16", tokens: float | None = None) -> str:
    """Users per GPU; each plan's bytes per user are `promised_bytes` at `context` tokens, stated in the heading."""
    measured = f" (quality measured at {tokens:,.0f} tokens)" if tokens else ""
    lines = [f"Users per GPU ({gpu_memory / GIB:g} GiB GPU, {weights / GIB:.2f} GiB weights, {context:,} tokens per "
             f"user{measured}), plans within {min_quality:g} points of the baseline.",
             f"Bytes per user: what the plan's cache holds after {context:,} tokens at {dtype}, per layer: tokens "
             "kept (all; a ratio's share; at most a budget; at most a sliding layer's window) x 2 x kv_heads x "
             "head_dim (fewer heads shared, lower rank) x the codec's bytes per value with its scales, plus its "
             "full-precision residual and sinks:"]
    for r in sorted(results, key=lambda r: -r.users):
        if r.delta >= -min_quality:
            lines.append(f"  {r.spec:46s} {r.bytes_per_user / GIB:8.3f} GiB per user -> {r.users:6d} users "
                         f"(score {r.score:.0f}, {r.delta:+.0f}){' *' if r.stretched else ''}")
    stretched = [r for r in results if r.stretched and r.delta >= -min_quality]
    if stretched and tokens:
        policy = parse_spec(stretched[0].spec)[0]
        lines.append(f"  *: keeps fewer of {context:,} tokens than of the {tokens:,.0f} its score was measured at "
                     f"(e.g. {kept_tokens(policy, context):,.0f} = {100 * kept_tokens(policy, context) / context:.0f}% "
                     f"instead of {100 * kept_tokens(policy, tokens) / tokens:.0f}%): the score does not carry over, "
                     "so it is not recommended for these users")
    dropped = [r.spec for r in results if r.delta < -min_quality]
    if dropped:
        lines.append(f"  left out (lost more than {min_quality:g} points): {', '.join(dropped)}")
    return "\n".join(lines)


def family(spec: str) -> str:
    policy, codec = parse_spec(spec)
    parts = []
    if policy.evicts:  # a budget or a ratio
        parts.append("eviction")
    while isinstance(codec, ReducingCodec):
        parts.append("sharing" if isinstance(codec, SharedHeadsCodec) else "low rank")
        codec = codec.storage
    if not codec.lossless:
        parts.append("quantization")
    return " + ".join(parts) if parts else "no compression"


def recommendation_text(best: PlanResult, results: list[PlanResult]) -> str:
    base = next(r for r in results if r.spec == "dynamic")
    bands = " / ".join(f"{name} {best.bands[name]:.0f}" for name, _, _ in BANDS if not math.isnan(best.bands[name]))
    retained = f", retention {best.retention:.0f}%" if not math.isnan(best.retention) else ""
    text = (
        f"Recommended: {best.spec} ({family(best.spec)}): {best.users} users instead of {base.users}, "
        f"{best.factor:.1f}x less KV memory than the uncompressed cache, score {best.score:.0f} vs {base.score:.0f}"
        + (f" ({bands})" if bands else "") + f"{retained}."
    )
    if best is not base:
        diff, lo, hi = paired_difference(best, base)
        verdict = ("cannot be told apart from the uncompressed cache on these samples" if lo <= 0 <= hi
                   else "measurably worse than the uncompressed cache" if hi < 0 else "measurably better")
        text += f"\nAgainst the uncompressed cache: {diff:+.1f} points [{lo:+.1f}, {hi:+.1f}]: {verdict}."
    ties = []
    for other in results:
        if other is best:
            continue
        diff, lo, hi = paired_difference(other, best)
        if lo <= 0 <= hi:
            ties.append(f"{other.spec} ({diff:+.1f} [{lo:+.0f}, {hi:+.0f}])")
    if ties:
        text += ("\nCannot be told apart from it on quality (95% interval of the paired difference includes 0): "
                 + "; ".join(ties) + ". Among those, memory decides.")
    else:
        text += "\nEvery other plan's quality differs from it measurably."
    return text


def study_plans(lengths: list[int], config=None, plans: tuple[str, ...] = STUDY_PLANS) -> list[str]:
    """`plans` (the registry's STUDY_PLANS by default) scaled to the shortest context, so eviction really drops
    part of every document."""
    head_dim = kv_shape_from_config(config).head_dim if config is not None else 64
    return study_specs(min(lengths), head_dim, plans)


def report_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "study.md"


__all__ = ["analyse", "recommend", "format_table", "format_users", "recommendation_text", "study_plans",
           "formula_bytes", "model_weight_bytes", "BASELINE_RULE", "EMBEDDED_MODELS"]


def _label_log_axis(axis, values: list[float]) -> None:
    """Plain-number labels on a log axis, as many as its span leaves room for.

    matplotlib's default labels every minor tick of a span under a decade or two as 2x10^0, 3x10^0, 4x10^0...,
    which overlap; here the labels sit at 1-9, 1-2-5 or the powers of ten of each decade, by the span.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # the eval extra's: plots only

    values = [v for v in values if v > 0 and math.isfinite(v)]
    decades = math.log10(max(values) / min(values)) if values else 3.0
    subs = tuple(range(1, 10)) if decades < 0.5 else (1, 2, 5) if decades <= 2 else (1,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_study(results: list[PlanResult], out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Score (with its 95% interval) against measured bytes; points are numbered and named in a key beside the
    axes, so no two labels can overlap however close the points sit."""
    import matplotlib  # the eval extra's: plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, key) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(results, 1):
        lo, hi = (r.band_ci or {}).get("all", (r.score, r.score))
        # red is the baseline's alone: the other plans cycle through the default colours without it (C3)
        color = "tab:red" if r.spec == "dynamic" else [f"C{k}" for k in range(10) if k != 3][i % 9]
        x = r.measured_bytes / 2**20
        ax.errorbar(x, r.score, yerr=[[max(0, r.score - lo)], [max(0, hi - r.score)]], fmt="o", color=color,
                    capsize=3, ms=5)
        ax.annotate(str(i), (x, r.score), fontsize=7, xytext=(4, 3), textcoords="offset points", color=color)
        key.text(0, 1 - i / (len(results) + 1), f"{i:2d}  {r.spec}  ({family(r.spec)})", fontsize=7, color=color,
                 family="monospace", transform=key.transAxes)
    key.axis("off")
    ax.set_xscale("log")
    _label_log_axis(ax.xaxis, [r.measured_bytes / 2**20 for r in results])
    ax.set_xlabel(f"KV cache after the document (MiB per sample, measured, at {dtype}, log scale)")
    ax.set_ylabel("score (0-100), 95% interval")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.set_title("Quality vs memory, every plan", fontsize=9)
    path = Path(out_dir) / "quality_vs_memory.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_results(results: list[PlanResult], lesson: list, path: str | Path, **about) -> Path:
    """The study's numbers as JSON (every plan, then the lesson's rows by plan), for notebooks and other reports."""
    def plan(r: PlanResult) -> dict:
        row = dataclasses.asdict(r)
        row.pop("scores")
        row["family"] = family(r.spec)
        return row

    data = {**about, "plans": [plan(r) for r in results],
            "lesson": [{"lesson": row.lesson, "lesson_factor": row.lesson_factor, "formula_factor": row.formula_factor,
                        "plan": row.result.spec if row.result is not None else None} for row in lesson]}
    path = Path(path)
    path.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return path


def read_results(path: str | Path) -> tuple[dict, list[PlanResult], list]:
    """What `write_results` wrote: (what was studied, the PlanResults, the lesson's rows as LessonRows)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    results = []
    for row in data.pop("plans"):
        row.pop("family")
        row["band_ci"] = {k: tuple(v) for k, v in (row["band_ci"] or {}).items()}
        row["retention_ci"] = tuple(row["retention_ci"])
        results.append(PlanResult(**row))
    by_spec = {r.spec: r for r in results}
    lesson = [LessonRow(row["lesson"], row["lesson_factor"], by_spec.get(row["plan"]), row["formula_factor"])
              for row in data.pop("lesson")]
    return data, results, lesson
