"""SnapKV: keep what the newest prompt tokens attend to, pooled over neighbours (arXiv:2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from .base import Policy, check_count, check_decoding, check_kept_tokens

POOLING = ("avg", "max")  # how a slot's score takes its neighbours' (`SnapKVPolicy.pooling`)


@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    """Score each slot by the attention it gets from an observation window of the newest queries, pooled.

    The end of a prompt (where the question usually sits) already attends to what generation will need (SnapKV,
    Sec. 3); pooling keeps the neighbours of a hit, so a needle survives whole. Each prompt step's `window` newest
    queries add to the running scores (a prompt fed in chunks is scored and evicted after each chunk). As in the paper
    (and kvpress), generated tokens are then appended and nothing is scored or evicted while decoding, so a decode
    step costs what a cache of the kept tokens costs; `decoding="evict"` also scores each decode step's query and
    evicts back to the budget (or ratio of the tokens seen), as H2O does.

    The defaults are SnapKV's reference code's (FasterDecoding/SnapKV `SnapKVCluster`) and kvpress's SnapKVPress's: a
    64-query window, kept whole, and an average over 5 neighbours. A prompt read at once is then ranked as
    SnapKVPress ranks it (the same kept pairs on a SmolLM2 needle prompt: rank correlation 1.000, where the 32-query
    window and max-pooling over 7 gave 0.864 and kept fewer of the answer's tokens at a quarter and an eighth;
    docs/results.md, "SnapKV and Expected Attention beside kvpress"); ours then also scores the question, a step of
    its own after the document, which kvpress's pipeline appends unscored.

    Args:
        budget: tokens kept per KV head, the recent ones included (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        window: newest queries of a step whose attention counts (the observation window).
        kernel: width of the pooling over neighbouring slots (odd; 1 turns pooling off).
        pooling: "avg" (the mean of the `kernel` neighbours' scores, zeros past the ends, as the reference code and
            kvpress) or "max" (their largest).
        recent: newest tokens always kept (SnapKV keeps its observation window).
        sink_tokens: first tokens always kept.
        decoding: "append" (generated tokens are kept: the cache grows by one token per decode step beyond the
            budget or ratio the prompt was compressed to) or "evict" (each decode step is scored and evicted).
    """

    name: ClassVar[str] = "snapkv"

    budget: int | None = None
    ratio: float | None = None
    window: int = 64
    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"
    recent: int = 64
    sink_tokens: int = 0
    decoding: Literal["append", "evict"] = "append"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        check_count("window", self.window, minimum=1)
        check_count("kernel", self.kernel, minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1, got {self.kernel!r}")
        if self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")
        check_decoding(self.decoding)
        check_kept_tokens(self)

    @property
    def observed_queries(self) -> int:
        return self.window

    @property
    def evicts_while_decoding(self) -> bool:
        return self.decoding == "evict"

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        if self.kernel == 1:
            return accumulated
        batch, heads, slots = accumulated.shape
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pooled = pool(accumulated.reshape(batch * heads, 1, slots), self.kernel, 1, self.kernel // 2)
        return pooled.reshape(batch, heads, slots)
