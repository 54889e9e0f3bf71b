"""The lesson's plans, measured: bytes from the formula beside bytes a real cache held, and accuracy by depth.

The lesson computes each plan's memory and says the quality cost "is not visible here". The study runs every
plan of the registry on long-context recall tasks (question after the document), then turns the measurements
into the lesson's table, its "users per GPU" worked example, and a recommendation for the user's constraints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .budget import GIB, kv_shape_from_config, model_weight_bytes
from .codecs.fp8 import Fp8Codec
from .codecs.identity import IdentityCodec
from .codecs.intn import IntNCodec
from .registry import parse_spec, study_specs

# Depth bands of the lesson's warning: questions about the start and the middle are where eviction fails.
BANDS = (("start", 0, 33.4), ("middle", 33.4, 66.7), ("end", 66.7, 100.1))
EMBEDDED_MODELS = ("smollm2-135m", "gemma-3-270m")
# A model whose uncompressed needle score is below this shows no losses worth ranking.
BASELINE_RULE = 70.0


def bytes_per_value(spec: str, model_bytes: float) -> float:
    """The lesson's `bytes` factor for a plan: the codec's value width, scales and residual not counted."""
    codec = parse_spec(spec)[1]
    if isinstance(codec, IdentityCodec):
        return model_bytes
    if isinstance(codec, Fp8Codec):
        return 1.0
    if isinstance(codec, IntNCodec):
        return codec.bits / 8
    raise ValueError(f"no lesson formula for codec {type(codec).__name__} in {spec!r}")


def formula_bytes(spec: str, config, tokens: float, model_bytes: float) -> float:
    """The lesson's formula for one user of `tokens`: layers x kv_heads x head_dim x 2 x bytes x tokens kept.

    Sliding-window layers hold at most their window; the plan's eviction budget caps the full-attention layers.
    """
    shape = kv_shape_from_config(config)
    budget = parse_spec(spec)[0].budget
    per_token = 2 * shape.kv_heads * shape.head_dim * bytes_per_value(spec, model_bytes)
    windows = shape.windows or (None,) * shape.layers
    total = 0.0
    for window in windows:
        if window == 0:
            continue
        kept = tokens if window is None else min(tokens, window)
        if budget is not None and window is None:
            kept = min(kept, budget)
        total += per_token * kept
    return total


def promised_bytes(spec: str, config, tokens: int, model_bytes: float) -> float:
    """What the plan's cache holds for one user after `tokens` tokens, as `CompressedLayer.promised_bytes` counts
    it (codec rates, scales, the full-precision residual), without running the model; tested against measured."""
    import torch

    policy, codec = parse_spec(spec)
    shape = kv_shape_from_config(config)
    dtype = {4: torch.float32, 2: torch.bfloat16}.get(int(model_bytes), torch.float32)
    windows = shape.windows or (None,) * shape.layers
    total = 0.0
    for window in windows:
        if window == 0:
            continue
        evicts = window is not None or policy.budget is not None
        layer_codec = codec.for_policy(evicts) if hasattr(codec, "for_policy") else codec
        cap = (window - 1) if window is not None else policy.budget
        kept = tokens if cap is None else min(tokens, cap)
        if layer_codec.lossless:
            encoded = 0
        else:
            block = max(layer_codec.token_block("key"), layer_codec.token_block("value"))
            residual = getattr(layer_codec, "residual_length", 0)
            encoded = max(0, (kept - residual) // block * block)
        per_encoded = layer_codec.bytes_per_token(shape.head_dim, "key", dtype) + layer_codec.bytes_per_token(
            shape.head_dim, "value", dtype)
        total += shape.kv_heads * (encoded * per_encoded + (kept - encoded) * 2 * shape.head_dim * model_bytes)
        if layer_codec.sink_tokens and (encoded > 0 or kept < tokens):
            # full-precision sinks, copied at the first encoding or eviction: keys, values and an int64 slot each
            total += shape.kv_heads * layer_codec.sink_tokens * (2 * shape.head_dim * model_bytes + 8)
    return total


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


def depth_bands(records: list[dict]) -> dict[str, float]:
    out = {}
    for name, low, high in BANDS:
        scores = [r["score"] for r in records if low <= r["depth"] < high]
        out[name] = sum(scores) / len(scores) if scores else float("nan")
    return out


def analyse(records: list[dict], config, model_bytes: float, weights_bytes: float, gpu_memory: float,
            context: int, reserve: float = 0.0, usable_tasks: set[str] | None = None) -> list[PlanResult]:
    """One PlanResult per method, over the tasks in `usable_tasks` (those the baseline passes)."""
    if usable_tasks is not None:
        records = [r for r in records if r["task"] in usable_tasks]
    methods = list(dict.fromkeys(r["method"] for r in records))
    free = gpu_memory - weights_bytes - reserve
    by_method = {m: [r for r in records if r["method"] == m] for m in methods}
    base = by_method["dynamic"]
    base_bytes = sum(r["kv_bytes_document"] for r in base) / len(base)
    base_score = sum(r["score"] for r in base) / len(base)
    results = []
    for method, rows in by_method.items():
        tokens = sum(r["document_tokens"] for r in rows) / len(rows)
        measured = sum(r["kv_bytes_document"] for r in rows) / len(rows)
        formula = formula_bytes(method, config, tokens, model_bytes)
        score = sum(r["score"] for r in rows) / len(rows)
        per_user = promised_bytes(method, config, context, model_bytes)
        users = max(0, math.floor(free / per_user)) if per_user > 0 else 0
        results.append(PlanResult(method, formula, measured, base_bytes / measured, depth_bands(rows), score,
                                  score - base_score, per_user, users))
    return results


def recommend(results: list[PlanResult], min_quality: float) -> PlanResult:
    """The plan serving the most users among those within `min_quality` points of the baseline."""
    eligible = [r for r in results if r.delta >= -min_quality]
    return max(eligible, key=lambda r: (r.users, r.score, -r.measured_bytes))


def format_table(results: list[PlanResult], tokens: float) -> str:
    lines = [
        f"{'plan':44s} {'formula':>10s} {'measured':>10s} {'x smaller':>9s} {'start':>6s} {'middle':>6s} "
        f"{'end':>6s} {'all':>6s}",
        f"{'':44s} {'(MiB, ' + format(tokens, '.0f') + ' tok)':>21s}",
    ]
    for r in results:
        b = r.bands
        lines.append(
            f"{r.spec:44s} {r.formula_bytes / 2**20:10.2f} {r.measured_bytes / 2**20:10.2f} {r.factor:9.1f} "
            f"{b['start']:6.0f} {b['middle']:6.0f} {b['end']:6.0f} {r.score:6.1f}"
        )
    return "\n".join(lines)


def residual_note(spec: str, tokens: float) -> str | None:
    """What an int codec's full-precision residual covers when `tokens` tokens are kept per layer, else None.

    KIVI keeps the `residual_length` most recent tokens unquantized; when a plan keeps no more than that (short
    prompts, or eviction to a small window) nothing is quantized and the plan costs what it would without it.
    """
    policy, codec = parse_spec(spec)
    residual = getattr(codec, "residual_length", 0)
    if not isinstance(codec, IntNCodec) or residual <= 0:
        return None
    kept = tokens if policy.budget is None else min(tokens, policy.budget)
    name = f"int{codec.bits}"
    if kept <= residual:
        return (f"{spec}: keeps {kept:.0f} tokens per layer, all within {name}'s full-precision residual "
                f"(residual_length={residual}): nothing is quantized, so it costs what it would without {name}")
    return (f"{spec}: the {residual} most recent of {kept:.0f} kept tokens stay in full precision "
            f"(residual_length={residual}); the saving approaches what {codec.bits} bits promise only on much longer prompts")


def residual_notes(results: list[PlanResult], tokens: float) -> str:
    """The notes of `residual_note` for the table's plans, one per line (empty if no plan quantizes to ints)."""
    notes = [note for note in (residual_note(r.spec, tokens) for r in results) if note]
    return "\n".join(["Full-precision residual (why int plans save less than their bits at this length):",
                      *(f"  {n}" for n in notes)]) if notes else ""


def format_users(results: list[PlanResult], min_quality: float, gpu_memory: float, weights: float, context: int) -> str:
    lines = [f"Users per GPU ({gpu_memory / GIB:g} GiB GPU, {weights / GIB:.2f} GiB weights, {context:,} tokens per "
             f"user), plans within {min_quality:g} points of the baseline:"]
    for r in sorted(results, key=lambda r: -r.users):
        if r.delta >= -min_quality:
            lines.append(f"  {r.spec:44s} {r.bytes_per_user / GIB:8.3f} GiB per user -> {r.users:6d} users "
                         f"(score {r.score:.0f}, {r.delta:+.0f})")
    dropped = [r.spec for r in results if r.delta < -min_quality]
    if dropped:
        lines.append(f"  left out (lost more than {min_quality:g} points): {', '.join(dropped)}")
    return "\n".join(lines)


def recommendation_text(best: PlanResult, results: list[PlanResult]) -> str:
    base = next(r for r in results if r.spec == "dynamic")
    policy, codec = parse_spec(best.spec)
    family = "eviction" if policy.evicts else ("quantization" if not codec.lossless else "no compression")
    return (
        f"Recommended: {best.spec} ({family}): {best.users} users instead of {base.users}, "
        f"{best.factor:.1f}x less KV memory than the uncompressed cache, score {best.score:.0f} vs {base.score:.0f} "
        f"(start {best.bands['start']:.0f} / middle {best.bands['middle']:.0f} / end {best.bands['end']:.0f})."
    )


def study_plans(lengths: list[int]) -> list[str]:
    """The registry's plans scaled to the shortest context, so eviction really drops part of every document."""
    return study_specs(min(lengths))


def report_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "study.md"


__all__ = ["analyse", "recommend", "format_table", "format_users", "recommendation_text", "study_plans",
           "formula_bytes", "model_weight_bytes", "BASELINE_RULE", "EMBEDDED_MODELS"]
