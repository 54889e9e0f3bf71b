"""Move RoPE-rotated keys to other positions, as StreamingLLM does when evicted tokens leave gaps."""

from __future__ import annotations

import torch


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate keys [B, H, T, D] by `delta` [B, H, T] positions (rotate-half RoPE, as in Llama-family models).

    Rotations compose, so a key rotated at position p and re-rotated by delta equals the key rotated at p + delta.
    Only the first 2 * len(inv_freq) channels carry RoPE (partial rotary models leave the rest alone).
    """
    rot = 2 * inv_freq.shape[0]
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)  # [B, H, T, rot/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x = keys[..., :rot].float()
    half = rot // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    out = (x * cos + rotated_half * sin).to(keys.dtype)
    return torch.cat([out, keys[..., rot:]], dim=-1) if rot < keys.shape[-1] else out
