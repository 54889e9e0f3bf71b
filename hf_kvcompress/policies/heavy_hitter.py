"""Heavy hitters + recent window, H2O (arXiv:2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_kept_tokens


@dataclass(frozen=True)
class HeavyHitterPolicy(Policy):
    """Keep the `recent` newest tokens plus those that have received the most attention so far, per KV head.

    A small set of tokens collects most of the attention mass (H2O, Sec. 3); their accumulated attention, summed
    over the query heads that share a KV head, ranks them at every step of prefill and decoding.

    Args:
        budget: tokens kept per KV head, recent and sinks included (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        recent: newest tokens always kept.
        sink_tokens: first tokens always kept (0 in H2O; StreamingLLM's sinks can be added).
    """

    name: ClassVar[str] = "h2o"

    budget: int | None = None
    recent: int = 64
    sink_tokens: int = 0
    ratio: float | None = None
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        check_kept_tokens(self)

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor | None:
        return accumulated
