"""Asymmetric integer quantization of keys and values, KIVI-style (arXiv:2402.02750), truly bit-packed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..ops.bitpack import PACKABLE_BITS, pack, unpack
from .base import Codec, Encoded, Kind

KEY_AXES = ("channel", "token")


def _quantize(x: torch.Tensor, bits: int, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max asymmetric quantization over `reduce_dim`; scale and zero point kept in fp16."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=reduce_dim, keepdim=True).to(torch.float16)
    hi = x.amax(dim=reduce_dim, keepdim=True).to(torch.float16)
    scale = ((hi.float() - lo.float()) / levels).clamp(min=1e-8).to(torch.float16)
    codes = ((x.float() - lo.float()) / scale.float()).round().clamp(0, levels)
    return codes, scale, lo


@dataclass(frozen=True)
class IntNCodec(Codec):
    """int8 / int4 / int2 with a scale and zero point per group of `group_size` values.

    Values are quantized per token (groups along the channels). Keys, whose outliers sit in fixed channels, are
    quantized per channel with groups of `group_size` tokens (KIVI) when `key_axis="channel"`; such a group can only
    be encoded once it is full and cannot lose single tokens, so evicting policies need `key_axis="token"`.
    `residual_length` recent tokens stay at full precision; older ones are encoded once, a group at a time, and
    never re-quantized. Per-channel groups run over token slots shared by a batch, so a left-padded row equals the
    row alone only when its padding is a whole number of groups (the cache warns otherwise).

    Args:
        bits: 2, 4 or 8 bits per value.
        group_size: values sharing one fp16 scale and zero point.
        residual_length: recent tokens kept at full precision.
        key_axis: "channel" (KIVI) or "token"; None picks "channel" without eviction and "token" with it.
    """

    bits: int = 4
    group_size: int = 32
    residual_length: int = 128
    key_axis: Literal["channel", "token"] | None = field(default=None)

    def __post_init__(self):
        if self.bits not in PACKABLE_BITS:
            raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")
        if not isinstance(self.residual_length, int) or self.residual_length < 0:
            raise ValueError(f"residual_length must be an integer >= 0, got {self.residual_length!r}")
        if self.key_axis is not None and self.key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES} or None, got {self.key_axis!r}")

    def for_policy(self, evicts: bool) -> "IntNCodec":
        """Settle `key_axis`: per-channel key groups cannot lose single tokens, so eviction needs per-token keys."""
        from dataclasses import replace

        if self.key_axis is None:
            return replace(self, key_axis="token" if evicts else "channel")
        if self.key_axis == "channel" and evicts:
            raise ValueError(
                "key_axis='channel' groups keys across tokens and cannot be combined with an evicting policy; "
                "use key_axis='token' (or leave key_axis unset)"
            )
        return self

    def _per_channel(self, kind: Kind) -> bool:
        return kind == "key" and self.key_axis == "channel"

    def token_block(self, kind: Kind) -> int:
        return self.group_size if self._per_channel(kind) else 1

    def check_head_dim(self, head_dim: int) -> None:
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ValueError(f"head_dim {head_dim} cannot be packed at {self.bits} bits")
        if head_dim % self.group_size and self.key_axis != "channel":
            raise ValueError(
                f"group_size must divide head_dim ({head_dim}) for per-token groups, got {self.group_size}"
            )

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        b, h, t, d = states.shape
        if self._per_channel(kind):
            g = self.group_size
            if t % g:
                raise ValueError(f"per-channel key groups need a multiple of {g} tokens, got {t}")
            grouped = states.reshape(b, h, t // g, g, d)
            codes, scale, zero = _quantize(grouped, self.bits, reduce_dim=3)
            return {
                "codes": pack(codes.reshape(b, h, t, d), self.bits),
                "scale": scale.reshape(b, h, t // g, d),
                "zero": zero.reshape(b, h, t // g, d),
            }
        grouped = states.reshape(b, h, t, d // self.group_size, self.group_size)
        codes, scale, zero = _quantize(grouped, self.bits, reduce_dim=4)
        return {"codes": pack(codes.reshape(b, h, t, d), self.bits), "scale": scale[..., 0], "zero": zero[..., 0]}

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(encoded["codes"], self.bits)
        b, h, t, d = codes.shape
        scale, zero = encoded["scale"].float(), encoded["zero"].float()
        if self._per_channel(kind):
            g = self.group_size
            out = codes.reshape(b, h, t // g, g, d).float() * scale[:, :, :, None, :] + zero[:, :, :, None, :]
        else:
            out = codes.reshape(b, h, t, d // self.group_size, self.group_size).float() * scale[..., None] + zero[..., None]
        return out.reshape(b, h, t, d).to(dtype)

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        # packed codes + fp16 scale and zero per group: (bits + 32 / group_size) / 8 bytes per value.
        return head_dim * self.bits / 8 + head_dim * 4 / self.group_size
