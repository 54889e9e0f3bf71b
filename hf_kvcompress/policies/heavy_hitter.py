"""Heavy hitters + recent window, H2O (arXiv:2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


@dataclass(frozen=True)
class HeavyHitterPolicy(Policy):
    """Keep the `recent` newest tokens plus those that have received the most attention so far, per KV head.

    A small set of tokens collects most of the attention mass (H2O, Sec. 3); their accumulated attention, summed
    over the query heads that share a KV head, ranks them at every step of prefill and decoding.

    Args:
        budget: tokens kept per KV head, recent and sinks included.
        recent: newest tokens always kept.
        sink_tokens: first tokens always kept (0 in H2O; StreamingLLM's sinks can be added).
    """

    budget: int = 512
    recent: int = 64
    sink_tokens: int = 0
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.recent, int) or self.recent < 0:
            raise ValueError(f"recent must be an integer >= 0, got {self.recent!r}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        floor = self.recent + self.sink_tokens
        if not isinstance(self.budget, int) or self.budget <= 0 or self.budget < floor:
            raise ValueError(
                f"budget must be a positive integer >= recent + sink_tokens ({floor}), got {self.budget!r}"
            )

    def score(self, accumulated: torch.Tensor | None, length: int) -> torch.Tensor | None:
        return accumulated
