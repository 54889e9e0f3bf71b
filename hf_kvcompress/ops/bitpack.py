"""Pack small unsigned integers into bytes along the last axis, so int4, int3 and int2 really take 4, 3 and 2 bits."""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 3, 4, 8)


def values_per_unit(bits: int) -> int:
    """How many codes fill a whole number of bytes: the last axis must be a multiple of this (3 bits: 8 in 3 bytes)."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    return 8 if bits == 3 else 8 // bits


def _check(codes: torch.Tensor, bits: int) -> int:
    unit = values_per_unit(bits)
    if codes.shape[-1] % unit:
        raise ValueError(f"the last axis ({codes.shape[-1]}) must be a multiple of {unit} to pack {bits}-bit codes")
    return unit


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integers in [0, 2**bits) -> [..., D * bits // 8] uint8."""
    unit = _check(codes, bits)
    if bits == 3:
        # 8 codes -> one 24-bit word -> 3 bytes.
        grouped = codes.to(torch.int32).view(*codes.shape[:-1], -1, 8)
        word = grouped[..., 0].clone()
        for i in range(1, 8):
            word |= grouped[..., i] << (3 * i)
        parts = [((word >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(3)]
        return torch.stack(parts, dim=-1).flatten(-2)
    codes = codes.to(torch.uint8)
    if unit == 1:
        return codes.contiguous()
    grouped = codes.view(*codes.shape[:-1], -1, unit)
    packed = grouped[..., 0].clone()
    for i in range(1, unit):
        packed |= grouped[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [..., D * bits // 8] uint8 -> [..., D] uint8."""
    unit = values_per_unit(bits)
    if bits == 3:
        triples = packed.to(torch.int32).view(*packed.shape[:-1], -1, 3)
        word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        parts = [((word >> (3 * i)) & 7).to(torch.uint8) for i in range(8)]
        return torch.stack(parts, dim=-1).flatten(-2)
    if unit == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(unit)]
    return torch.stack(parts, dim=-1).flatten(-2)
