"""KeyDiff: keep the keys least like the others, no attention needed (arXiv:2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_kept_tokens


@dataclass(frozen=True)
class KeyDiffPolicy(Policy):
    """Score each slot by how far its key points from the mean direction of the row's keys (negative cosine).

    KeyDiff (Sec. 3) finds that distinctive keys are the ones that get attention; the score reads only the keys,
    so it works with any attention kernel (flash, paged) and costs no attention statistics.

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        recent: newest tokens always kept.
        sink_tokens: first tokens always kept.
    """

    name: ClassVar[str] = "keydiff"

    budget: int | None = None
    ratio: float | None = None
    recent: int = 0
    sink_tokens: int = 0
    needs_keys: ClassVar[bool] = True

    def __post_init__(self):
        check_kept_tokens(self)

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)  # [B, H_kv, T, D]
        real = torch.ones(unit.shape[0], 1, unit.shape[2], 1, device=unit.device)
        if pads is not None:  # padding keys stay out of the mean, so a padded row scores as it would alone
            real = (torch.arange(unit.shape[2], device=unit.device)[None, :] >= pads[:, None]).float()[:, None, :, None]
        anchor = (unit * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(unit, anchor, dim=-1)
