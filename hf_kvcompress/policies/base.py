"""A policy decides which tokens stay in the cache: protected sinks and recent tokens, then the best-scored rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Policy:
    """Which kept slots survive when a layer holds more than `budget` tokens per KV head.

    Subclasses set `budget`, `sink_tokens` and `recent` and, if recency is not the criterion, `score()`.
    The layer owns all state; the policy is a frozen description, so one instance serves every layer.
    """

    needs_attention: ClassVar[bool] = False  # True: the layer must receive attention statistics (see hf/attention.py)

    @property
    def budget(self) -> int | None:
        """Tokens kept per KV head after eviction; None keeps everything."""
        return None

    @property
    def sink_tokens(self) -> int:
        return 0

    @property
    def recent(self) -> int:
        return 0

    @property
    def evicts(self) -> bool:
        return self.budget is not None

    def score(self, accumulated: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """Per-slot importance [B, H_kv, T]; None means recency (newer is more important)."""
        return None

    def spec(self) -> str:
        from ..registry import policy_spec

        return policy_spec(self)


def select_kept(policy: Policy, scores: torch.Tensor | None, pads: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    """Slots to keep, [B, H_kv, budget], ascending, per row and head.

    Padding slots (the first `pads[b]` of row b) go first and are never protected, so a row keeps padding only
    when it has fewer real tokens than the budget; its sinks are its first real tokens. Keeping the surviving
    padding at the front is what keeps transformers' 2-D padding mask aligned with the kept slots.
    """
    batch = pads.shape[0]
    device = pads.device
    slot = torch.arange(length, device=device)
    is_pad = slot[None, :] < pads[:, None]  # [B, T]
    if scores is None:
        priority = slot.to(torch.float32)[None, None, :].expand(batch, heads, length)
    else:
        priority = scores.to(torch.float32).expand(batch, heads, length)
    protected = (slot[None, :] < pads[:, None] + policy.sink_tokens) | (slot[None, :] >= length - policy.recent)
    protected = protected & ~is_pad
    priority = priority.masked_fill(protected[:, None, :], float("inf"))
    priority = priority.masked_fill(is_pad[:, None, :], float("-inf"))
    kept = torch.topk(priority, policy.budget, dim=-1, sorted=False).indices
    return kept.sort(dim=-1).values
