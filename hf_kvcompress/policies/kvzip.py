"""KVzip: keep what the model needs to reconstruct the context, whatever the question (arXiv:2505.23416)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import (
    Policy,
    check_count,
    check_decoding,
    check_floors,
    check_kept_tokens,
    check_share,
    resolve_span,
)

BUDGETS = ("uniform", "layer", "head", "token")


@dataclass(frozen=True)
class KVzipPolicy(Policy):
    """Score each cached pair by the most attention it gets while the model repeats the context.

    After the context is prefilled, `hf_kvcompress.prefill` has the model read "Repeat the previous context
    exactly." and the context again, in chunks, against the cache (KVzip, Sec. 3.2); a pair's score is the maximum
    attention it receives from those queries and from the query heads of its KV group. Pairs that no query needs
    to rebuild the context are evicted; the reconstruction tokens are never kept. The scores do not depend on the
    question, so one compressed cache answers many. Tokens that arrive later (questions, answers) are appended
    beyond the share (`decoding="append"`, KVzip's and kvpress's way; the default with head budgets), or rank
    above the context, which gives way to them to keep the share (`decoding="evict"`).

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`. A plain ratio below a half with no
            codec is planned as `bytes=ratio` (caches/plan.py `ratio_as_bytes`: the same bytes, more pairs in
            int4), and with the plain `int4` on a model without sliding-window layers as `bytes=ratio x 5/16` (the
            bytes those pairs take in int4, in the same byte plan). From a half up, with another codec (or `int4`
            with sliding-window layers), or with `sliding=`, `floors=` or other `budgets`, it is the share of the
            whole cache's pairs: on a model with sliding-window layers (Gemma 3) these keep fewer than their share
            of the window and the full-attention layers the pairs that frees (caches/plan.py, `SlidingShare`).
        bytes: share of the uncompressed cache's bytes kept, codec included, instead of `budget` or `ratio`
            (`kvzip:bytes=0.25`, `kvzip:bytes=0.1+int4`): counted in the dtype the model is served in (its
            config's 16-bit dtype, else bfloat16), against what transformers' own cache holds (a sliding layer its
            window). The plan turns it into the pairs kept (caches/plan.py, `ByteTarget`): at the ranking, the
            full-attention layers keep the best pairs whose bytes (the codec's rate, each pair's score, the
            full-precision residual and sinks) fit in what the sliding layers leave. Without a codec the
            full-attention layers are stored in int4 (`int4:residual_length=32`; on a model with sliding layers
            `int4:residual_length=8`, and these keep a wide window of their newest tokens in that int4: caches/plan.py,
            `byte_plan_codec`, `byte_codecs`). Tokens that
            arrive later (questions, answers) are stored at full precision and appended (`decoding="append"`), or
            held to `bytes` of their pairs, as a ratio holds them (`decoding="evict"`). Needs `budgets="head"`
            (the ranking of every pair, where each pair's bytes are counted).
        recent: newest tokens always kept (0 in KVzip): the end of the document, whatever its score. 128 gained
            two of 15 needles at each share on Gemma-3-270M and none on SmolLM2 (docs/results.md); not the default,
            since it is kept whatever the ratio and would refuse token budgets of 128 or less.
        budgets: how the kept pairs are shared out. "uniform": every KV head of every full-attention layer keeps
            the same number; "layer": one ranking of all layers' pairs sets each layer's number, as whole tokens per
            head (KVzip Sec. 3.3 across layers only); "head": one ranking of every (layer, KV head, token) pair (KVzip's
            own allocation), so each KV head keeps its own number of pairs, stored compactly (caches/head_store.py;
            needs the 'kvcompress_sdpa' attention for its per-head masks; the codec's full-precision sinks are
            always kept); "token": one ranking of the context's tokens, each scored by its best over every
            full-attention layer and KV head, so every such layer keeps the same tokens (caches/token_ranking.py).
            Which keeps more answers depends on the model's layout (few full-attention layers with one KV head
            favour "token", many layers and heads favour "head"; docs/results.md); "head" is the default.
        span: each pair also takes the best score of the `span` pairs after it in its head (0: its own score
            only, as in KVzip and kvpress's KVzipPress). The raw scores still decide how many pairs each layer and
            head keeps; `span` only decides which: each head spends its count on the runs of pairs before its peaks,
            so it keeps fewer distinct peaks. None (the default): chosen by the model's layout when the cache is
            built (`Policy.for_layout`; the cache's spec then names it): 4 on a model with sliding-window layers,
            0 without. On Gemma-3 at a quarter span 0 lost 2 of 5 middle answers that span 4 kept (development
            half, when the question still evicted pairs); on SmolLM2 span 0 kept every answer on the development
            half at a half, a quarter and an eighth, where span 4 kept 9 of 10 at an eighth (docs/results.md,
            "span by layout"). Among several alike needles (multi_needle) span 4 kept the numbers' digits in fewer
            pairs on SmolLM2 ("KVzip among distractor needles"): no one span holds everywhere.
        decoding: what the tokens after the document (questions, answers) cost. "append": nothing the ranking kept
            is evicted; they are kept beside it, so the cache holds the share of the document plus every later
            token (as in KVzip's paper and kvpress's KVzipPress, which evict nothing after the document). "evict":
            the share holds over every token seen, so each later token pushes the document's lowest-ranked pairs
            out (with an eviction slack, caches/head_store.py). Default: "append" with `budgets="head"` (the
            ranking the head store keeps), "evict" with the other budgets, whose token layers evict to the share;
            `decoding="append"` needs `budgets="head"`. At an eighth on SmolLM2's development half "evict" gave up
            about a quarter of the kept pairs to a question and lost answers that "append" keeps (docs/results.md,
            "KVzip at an eighth: the question evicted the answer").
        floors: per-layer floors of a planned ratio on a hybrid model (caches/plan.py, `SlidingShare.floors`): the
            share of the document each full-attention layer keeps at least before the ranking of every pair shares
            out the rest, calibrated per model (`hf-kvcompress calibrate --floors`, floor_calibration.py). None:
            the file shipped for the model, if any; a path: that file or a directory holding one; "none": no floors.
    """

    name: ClassVar[str] = "kvzip"

    budget: int | None = None
    ratio: float | None = None
    bytes: float | None = None
    sink_tokens: int = 0
    recent: int = 0
    budgets: str = "head"
    span: int | None = None  # None: by the model's layout (`for_layout`)
    decoding: str | None = None  # None: "append" with budgets="head", else "evict" (`resolved_decoding`)
    floors: str | None = None
    spec_none_is_text: ClassVar[tuple[str, ...]] = ("floors",)
    scores_by_reconstruction: ClassVar[bool] = True

    def __post_init__(self):
        if self.span is not None:
            check_count("span", self.span)
        check_floors(self.floors)
        if self.budgets not in BUDGETS:
            raise ValueError(f"budgets must be one of {', '.join(BUDGETS)}, got {self.budgets!r}")
        check_decoding(self.decoding, allow_none=True)
        if self.decoding == "append" and self.budgets != "head":
            raise ValueError(
                f"decoding='append' keeps what the ranking of every pair kept (budgets='head', the default); with "
                f"budgets={self.budgets!r} the layers evict to the share: give decoding='evict' or leave it out"
            )
        if self.bytes is None:
            check_kept_tokens(self)
            return
        check_share("bytes", self.bytes)
        if self.budget is not None or self.ratio is not None:
            raise ValueError(
                f"give one of budget (tokens), ratio (share of the tokens) or bytes (share of the bytes), not "
                f"several: got budget={self.budget!r}, ratio={self.ratio!r}, bytes={self.bytes!r}"
            )
        if self.budgets != "head":
            raise ValueError(
                f"bytes= counts each kept pair's bytes in the ranking of every pair: it needs budgets=head (the "
                f"default), got budgets={self.budgets!r}; give ratio= with the other budgets"
            )
        check_count("recent", self.recent)
        check_count("sink_tokens", self.sink_tokens)

    @property
    def evicts(self) -> bool:
        return self.bytes is not None or super().evicts

    @property
    def resolved_decoding(self) -> str:
        """`decoding`, or its default: "append" with head budgets, "evict" with the others."""
        if self.decoding is not None:
            return self.decoding
        return "append" if self.budgets == "head" else "evict"

    @property
    def evicts_while_decoding(self) -> bool:
        """False with `decoding="append"`: the head store evicts nothing after the ranking (caches/head_store.py)."""
        return self.resolved_decoding == "evict"

    def for_layout(self, windowed: bool) -> KVzipPolicy:
        """`span` settled by the model's layout (`resolve_span`)."""
        return dataclasses.replace(self, span=resolve_span(self.span, windowed))

    def with_byte_share(self, share: float) -> KVzipPolicy | None:
        """A plain ratio as `bytes=share`; None for a budget, a byte target already, or a knob of the ratio's own
        hybrid plan given (`sliding=`, `floors=`, budgets other than "head"), which keeps that plan for research."""
        if self.ratio is None or self.sliding is not None or self.floors is not None or self.budgets != "head":
            return None
        return dataclasses.replace(self, ratio=None, bytes=share)

    def kept_per_row(self, real_seen: torch.Tensor) -> torch.Tensor:
        """With `bytes`: `bytes` of the tokens seen (never fewer than sinks + recent), the share tokens that arrive
        after the ranking keep (they are stored at full precision); the ranking itself keeps what the byte
        target buys (caches/plan.py, `ByteTarget`)."""
        if self.bytes is None:
            return super().kept_per_row(real_seen)
        floor = torch.clamp(real_seen, max=self.sink_tokens + self.recent)
        return torch.maximum(torch.ceil(real_seen.double() * self.bytes).long(), floor)

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        return best_ahead(accumulated, self.span)


def best_ahead(scores: torch.Tensor, span: int | None) -> torch.Tensor:
    """Each pair of `scores` [B, H, T] takes the best score of itself and the `span` pairs after it in its head
    (KVzip's and KVzap's `span`; 0: the scores as they are). None: not yet settled by a layout, refused."""
    if span is None:
        raise ValueError(
            "span=None is chosen by the model's layout when the cache is built (make_cache(spec, model.config)); "
            "give span= (an integer >= 0) to score outside a cache"
        )
    if span == 0:
        return scores
    batch, heads, slots = scores.shape
    ahead = F.pad(scores.reshape(batch * heads, 1, slots), (0, span), value=float("-inf"))
    return F.max_pool1d(ahead, span + 1, 1).reshape(batch, heads, slots)
