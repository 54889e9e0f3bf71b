"""Attention sinks + recent window, StreamingLLM (arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Policy, check_count


@dataclass(frozen=True)
class SinkWindowPolicy(Policy):
    """Keep the first `sink_tokens` tokens and the most recent `window`.

    The first tokens soak up attention that has nowhere else to go; dropping them is what breaks a plain sliding
    window, keeping a handful lets the model stream for ever in bounded memory.

    Args:
        sink_tokens: first tokens always kept (StreamingLLM uses 4).
        window: most recent tokens kept (1024 when neither window nor ratio is given).
        ratio: share of the tokens seen that is kept (sinks included, the rest the newest), instead of `window`.
    """

    name: ClassVar[str] = "sink_window"

    sink_tokens: int = 4
    window: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        check_count("sink_tokens", self.sink_tokens)
        if self.window is not None and self.ratio is not None:
            raise ValueError(
                f"give either window (tokens) or ratio (share of the tokens seen), not both: got {self.window!r}, "
                f"{self.ratio!r}"
            )
        if self.ratio is not None:
            ratio = self.ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
            return
        if self.window is None:
            object.__setattr__(self, "window", 1024)
        check_count("window", self.window, minimum=1)

    @property
    def budget(self) -> int | None:
        if self.ratio is not None:
            return None
        assert self.window is not None  # `__post_init__` sets it when there is no ratio
        return self.sink_tokens + self.window

    @property
    def recent(self) -> int:
        if self.ratio is not None:
            return 0
        assert self.window is not None  # `__post_init__` sets it when there is no ratio
        return self.window
