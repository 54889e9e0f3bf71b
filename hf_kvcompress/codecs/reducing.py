"""Codecs that first shrink the states (fewer heads, fewer dimensions), then hand them to a storage codec."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field, replace

import torch

from ..spec_text import changed_fields, join_spec
from .base import Codec, Encoded, Kind, resolve_for_policy
from .identity import IdentityCodec


@dataclass(frozen=True)
class ReducingCodec(Codec):
    """`reduce` maps [B, H_kv, T, D] to a smaller tensor, `storage` stores it, `expand` maps it back.

    Stacking is how the lesson's combinations are built: `shared_heads+int8` shares heads, then quantizes the
    shared heads. The storage codec's residual and token blocks apply unchanged to the reduced states.
    """

    storage: Codec = field(default_factory=IdentityCodec)

    @abstractmethod
    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor: ...

    @abstractmethod
    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def stored_fraction(self, head_dim: int) -> tuple[int, float]:
        """(dims stored per stored head, KV heads per stored head)."""

    @property
    def residual_length(self) -> int:  # type: ignore[override]
        return getattr(self.storage, "residual_length", 0)

    def token_block(self, kind: Kind) -> int:
        return self.storage.token_block(kind)

    def for_policy(self, evicts: bool) -> "ReducingCodec":
        return replace(self, storage=resolve_for_policy(self.storage, evicts))

    def check_head_dim(self, head_dim: int) -> None:
        self.storage.check_head_dim(self.stored_fraction(head_dim)[0])

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        return self.storage.encode(self.reduce(states, kind), kind)

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return self.expand(self.storage.decode(encoded, kind, dtype), kind, dtype)

    def spec(self) -> str:
        """`name[:args]`, then `+storage` when the reduced states are stored by another codec (`shared_heads+int8`)."""
        head = join_spec(self.name, changed_fields(self, skip=("storage",)))
        return head if isinstance(self.storage, IdentityCodec) else f"{head}+{self.storage.spec()}"

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        dims, heads_per_stored = self.stored_fraction(head_dim)
        return self.storage.bytes_per_token(dims, kind, dtype) / heads_per_stored
