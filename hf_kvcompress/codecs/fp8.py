"""FP8 (E4M3) storage: one byte per value, the format serving engines offer as their low-risk KV option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Encoded, Kind

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


@dataclass(frozen=True)
class Fp8Codec(Codec):
    """float8_e4m3fn values with one fp16 scale per token and KV head.

    The scale maps each head vector's largest magnitude to E4M3's range, so outlier tokens do not saturate and
    every token is encoded on its own (evicting policies can drop tokens without re-encoding).

    Args:
        sink_tokens: the first real tokens of each row (padding excluded) that the cache keeps at full precision.
    """

    name: ClassVar[str] = "fp8"

    sink_tokens: int = 0
    attends_encoded: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        amax = states.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8)
        scale = (amax / FP8_MAX).to(torch.float16)
        # Round the scale to fp16 first, so encoding and decoding use the very same number.
        scaled = (states.float() / scale.float().clamp(min=1e-12)).clamp(-FP8_MAX, FP8_MAX)
        return {"values": scaled.to(torch.float8_e4m3fn), "scale": scale}

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return (encoded["values"].float() * encoded["scale"].float()).to(dtype)

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        return head_dim * 1 + 2
