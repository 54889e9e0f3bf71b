"""TOVA: keep what the newest query attends to (arXiv:2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_kept_tokens

HEADS = ("mean", "each")


@dataclass(frozen=True)
class TOVAPolicy(Policy):
    """Score each slot by the attention the newest query gives it; older statistics are forgotten.

    TOVA (Sec. 3) treats a decoder as a multi-state RNN and, at every step, drops the state the current query
    attends to least: no accumulation, so it has no bias towards old tokens as H2O's running sums have.

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        recent: newest tokens always kept (0 in TOVA).
        sink_tokens: first tokens always kept (0 in TOVA).
        heads: "mean": the newest query's attention averaged over all heads of the layer ranks the slots, so every
            KV head keeps the same tokens (TOVA's own choice, and kvpress's TOVAPress); "each": every KV head ranks
            by the attention of its own query heads. "mean" is the default because it kept more answers on the
            suite (docs/results.md).
    """

    name: ClassVar[str] = "tova"

    budget: int | None = None
    ratio: float | None = None
    recent: int = 0
    sink_tokens: int = 0
    heads: str = "mean"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {', '.join(HEADS)}, got {self.heads!r}")
        check_kept_tokens(self)

    @property
    def observed_queries(self) -> int:
        return 1

    def observe(self, accumulated: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return attention

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        return accumulated.mean(1, keepdim=True) if self.heads == "mean" else accumulated
