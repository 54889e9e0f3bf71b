"""KVzap: KVzip's scores from one read of the context, by a probe on each token's hidden state (arXiv:2601.07891)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_count, check_decoding, check_floors, check_kept_tokens, resolve_span
from .kvzip import best_ahead

BUDGETS = ("head", "uniform")


@dataclass(frozen=True)
class KVzapPolicy(Policy):
    """Score each pair by a per-layer probe's estimate of its KVzip score, as its token arrives.

    KVzip (policies/kvzip.py) scores a pair by the most attention it receives while the model repeats the context,
    which costs a second read of it. KVzap fits, per layer, a small model from the hidden state entering attention
    to the log of that score per KV head (probes.py; fitted by `hf-kvcompress calibrate --probe`), so a token is
    scored when it arrives: at prefill with no second pass, and at every decode step, so a `budget` bounds memory
    while generating.

    The probe's estimate is stored as p / (1 + p) of the estimated score p (monotone, below 1 as the attention
    probabilities KVzip ranks, so it ranks with them: head_ranking.py, head_store.py).

    Needs the model's config (the probe is per model) and `use_kvcompress_attention(model)`, whose hooks hand each
    cache layer the hidden state entering attention (hf/hidden_states.py).

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given). On a model with
            sliding-window layers, with head budgets, the sliding layers keep a half's planned share of their window
            (or `sliding=N`) and the full-attention layers the budget plus the allowance that leaves
            (caches/plan.py `plans_budget_share`): the same pairs in all as the budget in every layer.
        ratio: share of the tokens seen that is kept, instead of `budget`.
        sink_tokens: first tokens always kept.
        recent: newest tokens always kept (128, as KVzap keeps a recent window). The probe scores a token by its
            hidden state alone, so without a window a `ratio` evicts a question's own tokens in the step they
            arrive (a question appended to a compressed document lost every needle on the development half;
            docs/results.md). Counted within the budget: a `budget` below `recent + sink_tokens` is refused
            (give a smaller `recent`).
        span: each pair also takes the best score of the `span` pairs after it in its head (as KVzip's `span`;
            None, the default, is chosen by the model's layout as KVzip's is: 4 with sliding-window layers, else 0).
        budgets: how the kept pairs are shared out. "head" (the default): the prompt is held whole while it is
            read, then one ranking of every full-attention layer's (KV head, token) pairs by the probe's estimates
            decides what each head keeps, as KVzip's head budgets (caches/head_ranking.py); tokens after it
            (questions, answers, a generation) are scored by the probe as they arrive and, once older than
            `recent`, compete with the prompt's pairs; a `budget` or `ratio` holds each ranked layer to its share
            (caches/head_store.py). The ranking runs when `hf_kvcompress.prefill` ends, or on model.generate's
            path at the first one-token step. "uniform": every KV head keeps the same number of its best pairs,
            evicted as tokens arrive, so a `budget` bounds memory while the prompt is read too. On SmolLM2's
            development half the same share per head lost every needle that the head ranking kept
            (docs/results.md, "KVzap").
        decoding: what the tokens after the prompt's ranking (questions, answers, a generation) cost, as KVzip's
            `decoding`. "append": nothing the ranking kept is evicted; later tokens are kept beside it (scored, so a
            saved cache's ranks stay whole), so the cache holds the share of the prompt plus every later token.
            "evict": later tokens compete with the prompt's pairs by their probe scores and the share (or the
            budget) holds over every token seen, so a `budget` bounds memory through a long generation. Default
            (`resolved_decoding`): "append" for a `ratio` with `budgets="head"` (on SmolLM2's development half at
            an eighth "evict" kept 2 of 10 answers and "append" 10 of 10; the same 10 at a quarter), "evict" for a
            `budget` (it bounds memory while decoding) and with `budgets="uniform"`. `decoding="append"` needs
            `budgets="head"` (the ranking the head store keeps).
        probe: the probe file, or a directory holding one (None: the probe shipped for the model).
        floors: per-layer floors of a planned ratio on a hybrid model, as KVzip's `floors` (caches/plan.py,
            `SlidingShare.floors`; the same file, `hf-kvcompress calibrate --floors`): the share of the prompt each
            full-attention layer keeps at least before the ranking of every pair shares out the rest. They size a
            layer, not a pair, so KVzip's calibration serves the probe's ranking too. None: the file shipped for the
            model, if any (Gemma-3-270M's floors layer 11 at an eighth); a path: that file or a directory holding
            one; "none": no floors.
    """

    name: ClassVar[str] = "kvzap"

    budget: int | None = None
    ratio: float | None = None
    sink_tokens: int = 0
    recent: int = 128
    span: int | None = None  # None: by the model's layout (`for_layout`)
    probe: str | None = None
    budgets: str = "head"
    decoding: str | None = None  # None: by `resolved_decoding`
    floors: str | None = None
    spec_none_is_text: ClassVar[tuple[str, ...]] = ("floors",)
    needs_hidden_states: ClassVar[bool] = True

    def __post_init__(self):
        if self.span is not None:
            check_count("span", self.span)
        if self.budgets not in BUDGETS:
            raise ValueError(f"budgets must be one of {', '.join(BUDGETS)}, got {self.budgets!r}")
        check_decoding(self.decoding, allow_none=True)
        if self.decoding == "append" and self.budgets != "head":
            raise ValueError(
                f"decoding='append' keeps what the ranking of every pair kept (budgets='head', the default); with "
                f"budgets={self.budgets!r} every head evicts to its share as tokens arrive: give decoding='evict' or "
                f"leave it out"
            )
        check_floors(self.floors)
        if self.probe is not None and (not isinstance(self.probe, str) or not self.probe):
            raise ValueError(f"probe must be a path to a probe file or directory, got {self.probe!r}")
        check_kept_tokens(self)

    @property
    def ranks_prompt(self) -> bool:
        """Whether the cache ranks every layer's pairs once the prompt is read (`budgets="head"`)."""
        return self.budgets == "head" and self.evicts

    @property
    def resolved_decoding(self) -> str:
        """`decoding`, or its default: "append" for a ratio with head budgets, "evict" for a budget (which bounds
        memory while decoding) and with uniform budgets."""
        if self.decoding is not None:
            return self.decoding
        return "append" if self.budgets == "head" and self.ratio is not None else "evict"

    @property
    def evicts_while_decoding(self) -> bool:
        """False with `decoding="append"`: the head store evicts nothing after the ranking (caches/head_store.py)."""
        return self.resolved_decoding == "evict"

    def for_layout(self, windowed: bool) -> KVzapPolicy:
        """`span` settled by the model's layout (`resolve_span`)."""
        return dataclasses.replace(self, span=resolve_span(self.span, windowed))

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        return best_ahead(accumulated, self.span)
