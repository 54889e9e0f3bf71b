"""Keep every token: the policy of an uncompressed cache, and of caches that only change how tokens are stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Policy


@dataclass(frozen=True)
class KeepAllPolicy(Policy):
    """Never evicts."""

    name: ClassVar[str] = "dynamic"
