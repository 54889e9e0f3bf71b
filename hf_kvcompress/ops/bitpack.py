"""Pack small unsigned integers into bytes along the last axis, so int4 and int2 really take 4 and 2 bits."""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 4, 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integers in [0, 2**bits) -> [..., D * bits // 8] uint8."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    codes = codes.to(torch.uint8)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.contiguous()
    if codes.shape[-1] % per_byte:
        raise ValueError(f"the last axis ({codes.shape[-1]}) must be a multiple of {per_byte} to pack {bits}-bit codes")
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):
        packed |= grouped[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [..., D * bits // 8] uint8 -> [..., D] uint8."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).flatten(-2)
