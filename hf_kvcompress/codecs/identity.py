"""Full precision: tokens stored as the model produced them. The baseline every other codec is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Encoded, Kind


@dataclass(frozen=True)
class IdentityCodec(Codec):
    """Keeps keys and values in the model's own dtype."""

    name: ClassVar[str] = "identity"

    lossless: ClassVar[bool] = True

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        return {"states": states.contiguous()}

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return encoded["states"]

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        return head_dim * torch.empty((), dtype=dtype).element_size()
