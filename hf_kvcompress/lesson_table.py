"""The lesson's budget table with the column it says is missing: the quality each plan keeps, as the study measured.

The lesson computes its rows from the size formula alone ("the quality cost of each plan is not visible here").
Each row is matched to the study's best measured plan of the same family (its highest score, then its fewest
bytes); the table shows the lesson's saving at its 8B shape beside this model's formula and measured savings, the
score with its 95% interval and the retention.
"""

from __future__ import annotations

from collections.abc import Callable

from .budget import compression_plans
from .codecs.identity import IdentityCodec
from .codecs.intn import IntNCodec
from .codecs.lowrank import LowRankCodec
from .codecs.shared_heads import SharedHeadsCodec
from .registry import parse_spec
from .study import LessonRow, formula_bytes, score_cell


def _plain(codec, kind) -> bool:
    return type(codec) is kind


def _int(bits: int) -> Callable[[str], bool]:
    def match(spec: str) -> bool:
        policy, codec = parse_spec(spec)
        return not policy.evicts and isinstance(codec, IntNCodec) and codec.bits == bits
    return match


def _evict(spec: str) -> bool:
    policy, codec = parse_spec(spec)
    return policy.evicts and isinstance(codec, IdentityCodec)  # a budget or a ratio


def _shared(spec: str) -> bool:
    policy, codec = parse_spec(spec)
    return not policy.evicts and isinstance(codec, SharedHeadsCodec) and _plain(codec.storage, IdentityCodec)


def _lowrank(spec: str) -> bool:
    policy, codec = parse_spec(spec)
    return not policy.evicts and isinstance(codec, LowRankCodec) and _plain(codec.storage, IdentityCodec)


def _reduced_and_quantized(spec: str) -> bool:
    """The lesson's stack of fewer heads with fewer bytes, or its kin: one reducing codec (shared heads or low rank)
    storing its output with an int codec."""
    policy, codec = parse_spec(spec)
    return (not policy.evicts and isinstance(codec, (SharedHeadsCodec, LowRankCodec))
            and isinstance(codec.storage, IntNCodec))


# The lesson's rows in its order, each with the test a study plan must pass to stand for it. Where several plans
# pass, the family's best measured one stands for it: the highest score, then the fewest measured bytes (the study
# runs each family at its best setting, registry.STUDY_PLANS; a `--plans` list may hold several).
LESSON_ROWS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("quantize to INT8", _int(8)),
    ("quantize to INT4", _int(4)),
    ("evict: keep 4k tokens", _evict),
    ("share heads: GQA 8 KV", _shared),
    ("low-rank: 128 -> 32 dims", _lowrank),
    ("GQA 8 + INT8 combined", _reduced_and_quantized),
)


def lesson_rows(results: list, config, tokens: float, model_bytes: float) -> list[LessonRow]:
    """One LessonRow per lesson row; `results` are the study's PlanResults (the baseline `dynamic` among them)."""
    factors = {row.name: row.factor for row in compression_plans().rows}
    base = formula_bytes("dynamic", config, tokens, model_bytes)
    rows = []
    for name, match in LESSON_ROWS:
        # the family's best plan stands for it (sinks + window or KVzip, int4 or int8 storage, ...)
        best = min((r for r in results if match(r.spec)), key=lambda r: (-r.score, r.measured_bytes), default=None)
        formula = base / formula_bytes(best.spec, config, tokens, model_bytes) if best else float("nan")
        rows.append(LessonRow(name, factors[name], best, formula))
    return rows


def format_lesson_table(rows: list[LessonRow], baseline) -> str:
    """The lesson's table with the study's columns (one cell format for both tables: `score_cell`); `baseline` is
    the study's `dynamic` PlanResult."""
    lines = [
        f"{'the lesson (8B, 32k tokens)':26s} {'x less':>6s}   {'plan measured here':40s} {'formula':>7s} "
        f"{'measured':>8s} {'score, 95% interval':>19s} {'retention':>13s}",
        f"{'baseline FP16':26s} {1.0:6.1f}   {baseline.spec:40s} {1.0:7.1f} {1.0:8.1f} "
        f"{score_cell(baseline.score, (baseline.band_ci or {}).get('all')):>19s} {'':>13s}",
    ]
    for row in rows:
        r = row.result
        if r is None:
            lines.append(f"{row.lesson:26s} {row.lesson_factor:6.1f}   (no plan of this family in the study)")
            continue
        lines.append(
            f"{row.lesson:26s} {row.lesson_factor:6.1f}   {r.spec:40s} {row.formula_factor:7.1f} {r.factor:8.1f} "
            f"{score_cell(r.score, (r.band_ci or {}).get('all')):>19s} {score_cell(r.retention, r.retention_ci)}"
        )
    return "\n".join(lines)
