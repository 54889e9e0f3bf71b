"""Attention products read from bit-packed integer codes one bit plane at a time, without decoding the block.

`ops/bitpack.pack` puts code i of each byte in bits [bits*i, bits*(i+1)), so plane i of a [B, H, T, W] byte tensor
(W = D * bits / 8) holds dims i, i + u, i + 2u, ... (u = 8 // bits codes per byte). On CPU, interleaving the
planes back into [T, D] order (unpack's `stack`) and scaling every code (`codes * scale + zero` in fresh float32
buffers) were most of the decode time (docs/benchmark-notes.md); here each plane is converted to float32 once and
multiplied by the matching dims of the query. Groups that run along head_dim (values; keys with key_axis="token")
fold their scale and zero point into small products instead of the codes:

    logits[n, t] = sum_g scale[t, g] * (q_g . codes[t, g]) + zero[t, g] * sum(q_g)
    out[n, d]    = sum_t p[n, t] scale[t, g(d)] codes[t, d] + sum_t p[n, t] zero[t, g(d)]

Per-channel key groups (KIVI) scale each channel of a run of `group_size` tokens differently; folding that into
the query needs one query per token group (many tiny matmuls, measured slower), so those planes are scaled in
place instead and only the zero points are folded.

A codebook of 4 levels symmetric about 0 (the 2-bit Lloyd-Max levels, codebook="gaussian") is affine in the code
and its high bit: level(c) = L0 + a * c + b * (c >> 1), with a = L1 - L0, b = L2 - L0 - 2a. It folds the same way
with one more plane per code position.
"""

from __future__ import annotations

from functools import lru_cache

import torch

FOLDABLE_BITS = (2, 4, 8)


def affine_levels(levels: tuple[float, ...] | None) -> tuple[float, float, float] | None:
    """(L0, a, b) with level(c) = L0 + a*c + b*(c >> 1) for a 4-level codebook, (0, 1, 0) for the plain codes
    (None), or None when the codebook is not of that form (then attention decodes the block instead)."""
    if levels is None:
        return 0.0, 1.0, 0.0
    if len(levels) != 4:
        return None
    l0, l1, l2, l3 = levels
    a = l1 - l0
    b = l2 - l0 - 2 * a
    if abs(l0 + 3 * a + b - l3) > 1e-6 * max(1.0, abs(l3)):
        return None
    return l0, a, b


def _code_plane(packed: torch.Tensor, bits: int, i: int) -> torch.Tensor:
    """Code i of every byte of `packed` (uint8, the shape of `packed`)."""
    shifted = packed >> (bits * i) if i else packed
    return shifted & ((1 << bits) - 1) if i < 8 // bits - 1 else shifted  # the top code needs no mask


def planes(packed: torch.Tensor, bits: int, high_bits: bool) -> torch.Tensor:
    """[B, H, T, W] packed codes -> [B, H, P, T, W] float32: the u code planes, then (`high_bits`) the u planes of
    each code's top bit. Plane-major, so each plane is written contiguously (a strided write was several times
    slower)."""
    unit = 8 // bits
    b, h, t, w = packed.shape
    out = torch.empty(b, h, unit * (2 if high_bits else 1), t, w, dtype=torch.float32, device=packed.device)
    if unit == 1:
        out[:, :, 0].copy_(packed)
        return out
    for i in range(unit):
        out[:, :, i].copy_(_code_plane(packed, bits, i))
        if high_bits:
            out[:, :, unit + i].copy_((packed >> (bits * i + bits - 1)) & 1)
    return out


def _float32_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of `tensor` in one pass (`.float().contiguous()` of a bfloat16 view takes two)."""
    return torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device).copy_(tensor)


def _plane_query(query: torch.Tensor, unit: int) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, u, n, W]: the dims each code plane holds (dim j*u + i in plane i, column j)."""
    b, h, n, d = query.shape
    return query.reshape(b, h, n, d // unit, unit).permute(0, 1, 4, 2, 3)


@lru_cache(maxsize=64)
def _owner(width: int, group_size: int, unit: int, groups: int, device: torch.device) -> torch.Tensor:
    """[G, W] float32 one-hot: which head_dim group each byte column of a plane belongs to (cached: a decode step
    asks for the same few every layer)."""
    column_group = torch.arange(width, device=device) // (group_size // unit)
    return (column_group[None, :] == torch.arange(groups, device=device)[:, None]).float()


def token_group_logits(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, query: torch.Tensor, bits: int, group_size: int,
    levels: tuple[float, float, float],
) -> torch.Tensor:
    """q . key for keys quantized in groups along head_dim: packed [B, H, T, W], scale and zero [B, H, T, G],
    query [B, H, n, D] -> logits [B, H, n, T]. `levels`: (L0, a, b) from `affine_levels`."""
    l0, a, hb = levels
    unit = 8 // bits
    b, h, n, d = query.shape
    t, w = packed.shape[2], packed.shape[3]
    groups = d // group_size
    codes = planes(packed, bits, high_bits=hb != 0.0)  # [B, H, P, T, W]
    plane_q = _plane_query(query, unit)  # [B, H, u, n, W]
    if hb != 0.0:
        plane_q = torch.cat([plane_q * a, plane_q * hb], dim=2)
    elif a != 1.0:
        plane_q = plane_q * a
    # One row per (query, group), zero outside the group's columns: a block-diagonal query per plane.
    owner = _owner(w, group_size, unit, groups, query.device)
    block_q = (plane_q[:, :, :, :, None, :] * owner).reshape(b, h, -1, n * groups, w)
    # (q_g . level_g) - L0 sum(q_g) per (query, group, token):
    raw = torch.matmul(block_q, codes.transpose(-1, -2)).sum(2).view(b, h, n, groups, t)
    q_sum = query.reshape(b, h, n, groups, group_size).sum(-1, keepdim=True)  # [B, H, n, G, 1]
    if l0 != 0.0:
        raw = raw + l0 * q_sum
    # logits = sum_g scale_g * raw_g + zero_g * sum(q_g), one group at a time over [B, H, n, T] (a broadcast
    # product and a sum over G, or a matmul with G columns, took twice as long on CPU).
    scale_t = _float32_copy(scale.transpose(-1, -2))[:, :, None]  # [B, H, 1, G, T]
    zero_t = _float32_copy(zero.transpose(-1, -2))[:, :, None]
    logits = raw[:, :, :, 0] * scale_t[:, :, :, 0]
    logits.addcmul_(q_sum[:, :, :, 0], zero_t[:, :, :, 0])
    for g in range(1, groups):
        logits.addcmul_(raw[:, :, :, g], scale_t[:, :, :, g]).addcmul_(q_sum[:, :, :, g], zero_t[:, :, :, g])
    return logits


def token_group_mix(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, probs: torch.Tensor, bits: int, group_size: int,
    levels: tuple[float, float, float],
) -> torch.Tensor:
    """probs [B, H, n, T] times values quantized in groups along head_dim (packed [B, H, T, W], scale and zero
    [B, H, T, G]) -> [B, H, n, D]. The probabilities take each token's scale; only the small output is
    interleaved back into head_dim order."""
    l0, a, hb = levels
    unit = 8 // bits
    b, h, n, t = probs.shape
    w = packed.shape[3]
    d = w * unit
    groups = d // group_size
    codes = planes(packed, bits, high_bits=hb != 0.0)  # [B, H, P, T, W]
    # float32 probabilities times the scales in their stored dtype: the product is float32 of the same values.
    scaled = probs[:, :, :, None, :] * scale.transpose(-1, -2)[:, :, None]  # [B, H, n, G, T]
    # Expanded over the planes explicitly: a broadcast batch dim made matmul twice as slow on CPU.
    raw = torch.matmul(scaled.reshape(b, h, 1, n * groups, t).expand(b, h, codes.shape[2], n * groups, t), codes)
    if hb != 0.0:
        raw = raw[:, :, :unit] * a + raw[:, :, unit:] * hb
    elif a != 1.0:
        raw = raw * a
    # Each column keeps the row of its own group: [B, H, u, n, G, W] -> [B, H, u, n, W].
    owner = _owner(w, group_size, unit, groups, probs.device)
    out = (raw.view(b, h, unit, n, groups, w) * owner[:, :]).sum(4)
    if l0 != 0.0:  # sum_t p scale * L0, per group
        out = out + (l0 * scaled.sum(-1)).repeat_interleave(group_size // unit, dim=-1)[:, :, None]
    out = out.permute(0, 1, 3, 4, 2).reshape(b, h, n, d)  # dim j*u + i <- plane i, column j
    zeros = torch.matmul(probs, zero.float())  # [B, H, n, G]
    return out.add_(zeros.repeat_interleave(group_size, dim=-1))


def channel_group_logits(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, query: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """q . key for keys quantized per channel in groups of `group_size` tokens (KIVI): packed [B, H, T, W], scale
    and zero [B, H, T / group_size, D], query [B, H, n, D] -> logits [B, H, n, T]. Each plane is scaled in place
    (no interleave, no fresh buffer); the zero points fold into one product per token group."""
    unit = 8 // bits
    b, h, n, d = query.shape
    t, w = packed.shape[2], packed.shape[3]
    codes = planes(packed, bits, high_bits=False)  # [B, H, u, T, W]
    plane_scale = _plane_query(scale, unit)  # [B, H, u, T/g, W], in the stored dtype: mul_ reads it as float32
    codes.view(b, h, unit, t // group_size, group_size, w).mul_(plane_scale[:, :, :, :, None, :])
    logits = torch.matmul(_plane_query(query, unit), codes.transpose(-1, -2)).sum(2)  # [B, H, n, T]
    zeros = torch.matmul(query, zero.float().transpose(-1, -2))  # [B, H, n, T/g]
    return logits.view(b, h, n, t // group_size, group_size).add_(zeros[..., None]).view(b, h, n, t)


def channel_group_logits_by_offset(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, offset_query: torch.Tensor, bits: int,
    group_size: int,
) -> torch.Tensor:
    """`channel_group_logits` for keys whose token at offset o of its group is read with its own query
    (pre_rope: a key was turned back by o before it was stored, so q . key = (q turned back by o) . stored key):
    offset_query [B, H, n, group_size, D] -> logits [B, H, n, T]. The planes are written offset-major
    [u, offset, group, W], so each offset is one contiguous matmul and the scale multiplies long contiguous runs
    (a permuted copy of token-major planes cost more than the rest together)."""
    unit = 8 // bits
    b, h, n, g, d = offset_query.shape
    t, w = packed.shape[2], packed.shape[3]
    groups = t // g
    codes = torch.empty(b, h, unit, g, groups, w, dtype=torch.float32, device=packed.device)
    for i in range(unit):
        codes[:, :, i].copy_(_code_plane(packed, bits, i).view(b, h, groups, g, w).transpose(2, 3))
    codes.mul_(_plane_query(scale, unit)[:, :, :, None])  # [B, H, u, 1, T/g, W]: one scale per group
    plane_q = _plane_query(offset_query.reshape(b, h, n * g, d), unit).reshape(b, h, unit, n, g, w)
    raw = torch.matmul(plane_q.transpose(3, 4), codes.transpose(-1, -2)).sum(2)  # [B, H, g, n, T/g]
    zeros = torch.matmul(offset_query.reshape(b, h, n * g, d), zero.float().transpose(-1, -2))  # [B, H, n*g, T/g]
    logits = raw.transpose(2, 3) + zeros.view(b, h, n, g, groups)  # [B, H, n, offset, group]
    return logits.transpose(-1, -2).reshape(b, h, n, t)  # token = group * g + offset
