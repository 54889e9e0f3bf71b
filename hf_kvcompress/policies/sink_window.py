"""Attention sinks + recent window, StreamingLLM (arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True)
class SinkWindowPolicy(Policy):
    """Keep the first `sink_tokens` tokens and the most recent `window`.

    The first tokens soak up attention that has nowhere else to go; dropping them is what breaks a plain sliding
    window, keeping a handful lets the model stream for ever in bounded memory.

    Args:
        sink_tokens: first tokens always kept (StreamingLLM uses 4).
        window: most recent tokens kept.
    """

    sink_tokens: int = 4
    window: int = 1024

    def __post_init__(self):
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if not isinstance(self.window, int) or self.window <= 0:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")

    @property
    def budget(self) -> int:
        return self.sink_tokens + self.window

    @property
    def recent(self) -> int:
        return self.window
