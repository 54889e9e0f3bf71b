"""Random eviction: the floor any scoring rule has to beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_count, check_kept_tokens


@dataclass(frozen=True)
class RandomPolicy(Policy):
    """Score each slot by a pseudo-random number drawn from its position, KV head and `seed`.

    Drawing from the position (not from a generator's stream) makes the choice the same for a row alone and for the
    same row in a padded batch, and the same at every step for a token that stays.

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        seed: changes the draw.
        recent: newest tokens always kept.
        sink_tokens: first tokens always kept.
    """

    name: ClassVar[str] = "random"

    budget: int | None = None
    ratio: float | None = None
    seed: int = 0
    recent: int = 0
    sink_tokens: int = 0
    needs_positions: ClassVar[bool] = True

    def __post_init__(self):
        check_count("seed", self.seed)
        check_kept_tokens(self)

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        mixed = positions.long() * 1_000_003 + heads * 7_919 + self.seed * 104_729
        # A multiplicative hash (Knuth), reduced below 2**24 so float32 holds every value exactly.
        return ((mixed * 2_654_435_761) % 16_777_213).float()
