"""A sliding-window layer's window, evicted a whole key group at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Policy, check_count


@dataclass(frozen=True)
class BlockWindowPolicy(Policy):
    """Keep at least the newest `window` tokens; drop the oldest tokens only `block` at a time.

    Per-channel key groups (KIVI) quantize `block` tokens together and cannot lose single tokens, so a sliding
    layer that stores them drops the oldest whole group(s) once every token of the group is older than the window.
    The layer then holds between `window` and `window + block - 1` tokens; the ones older than the window stay
    invisible because transformers' sliding mask hides them by absolute position (`get_mask_sizes`). Layers with
    this policy drop blocks in caches/layer.py `_drop_old_blocks` instead of ranking slots.

    Args:
        window: newest tokens always kept (transformers keeps `sliding_window - 1` between steps).
        block: tokens dropped together, the codec's `token_block("key")` (> 1; 1 is SinkWindowPolicy's exact window).
    """

    name: ClassVar[str] = "block_window"

    window: int = 1024
    block: int = 32

    def __post_init__(self):
        check_count("window", self.window, minimum=1)
        check_count("block", self.block, minimum=2)

    @property
    def budget(self) -> int:
        """The most tokens held: `window + block - 1`."""
        return self.window + self.block - 1

    @property
    def recent(self) -> int:
        return self.window

    def held(self, tokens: int) -> int:
        """Tokens held once `tokens` have arrived: the newest `window`, plus the older ones of a block that has not
        wholly left the window."""
        return tokens if tokens <= self.window else self.window + (tokens - self.window) % self.block

    @property
    def drops_blocks(self) -> bool:
        return True
