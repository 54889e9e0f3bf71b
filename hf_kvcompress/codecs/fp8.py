"""FP8 (E4M3) storage: one byte per value, the format serving engines offer as their low-risk KV option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.cpu_decode import KernelLayout
from .base import Codec, Encoded, Kind

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# An E4M3 byte's exponent and mantissa bits, moved into a float16's, make that float16 the value / 2**8 (both
# formats' subnormals line up); the factor goes into the scale.
_HALF_SHIFT, _HALF_FACTOR = 7, 256.0


def e4m3_as_float(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float8_e4m3fn [...] -> (float32 [...], factor) with values == result * factor, exactly (NaN reads as
    +-480: the encoder never writes one from finite states, and a NaN state makes its token's scale NaN).

    On CPU, `.float()` on float8 runs a scalar conversion (about 30 ns per value, NOTES.md); three integer ops and a
    float16 conversion are vectorised and several times faster. Elsewhere the native conversion is used."""
    if not values.is_cpu:
        return values.float(), 1.0
    bits = values.view(torch.int8).to(torch.int16)  # the sign bit extends over the top byte
    # << 7: sign to bit 15 (and bit 14, cleared), exponent to bits 10-13, mantissa to bits 7-9.
    bits.bitwise_left_shift_(_HALF_SHIFT).bitwise_and_(~0x4000)
    return bits.view(torch.float16).float(), _HALF_FACTOR


@dataclass(frozen=True)
class Fp8Codec(Codec):
    """float8_e4m3fn values with one fp16 scale per token and KV head.

    The scale maps each head vector's largest magnitude to E4M3's range, so outlier tokens do not saturate and
    every token is encoded on its own (evicting policies can drop tokens without re-encoding). Tokens are encoded as
    they arrive and attention reads them as stored, the step's own included, so the answer does not depend on how
    tokens are grouped into steps (prompt chunks, speculative decoding).

    Args:
        sink_tokens: the first real tokens of each row (padding excluded) that the cache keeps at full precision.
    """

    name: ClassVar[str] = "fp8"

    sink_tokens: int = 0  # type: ignore[misc]  # a field here; the base's class default serves codecs without one
    attends_encoded: ClassVar[bool] = True
    # With no residual, a step's own tokens read at full precision were the only thing that made a multi-token
    # step (speculative decoding's verification) answer other tokens than the same tokens fed one at a time.
    encodes_on_arrival: ClassVar[bool] = True

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
        values, factor = e4m3_as_float(encoded["values"])
        return (values * (encoded["scale"].float() * factor)).to(dtype)

    def key_logits(self, encoded: Encoded, query: torch.Tensor) -> torch.Tensor:
        # One scale per token: it multiplies that token's logit instead of its D values.
        values, factor = e4m3_as_float(encoded["values"])
        scale = encoded["scale"].float()[..., 0] * factor  # [B, H, T]
        return torch.matmul(query, values.transpose(-1, -2)).mul_(scale[:, :, None, :])

    def mix_values(self, encoded: Encoded, probs: torch.Tensor) -> torch.Tensor:
        values, factor = e4m3_as_float(encoded["values"])
        scale = encoded["scale"].float()[..., 0] * factor
        return torch.matmul(probs * scale[:, :, None, :], values)

    def kernel_layout(self, kind: Kind) -> KernelLayout:
        return KernelLayout(bits=8, float8=True)

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        return head_dim * 1 + 2
