"""Move RoPE-rotated keys to other positions, as StreamingLLM does when evicted tokens leave gaps."""

from __future__ import annotations

import torch


def rope_turns(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., len(inv_freq)] float32 of turning by `delta` [...] positions, one per frequency: what
    `rope_table` repeats for both halves, and what a kernel that turns in rotate-half order reads (lowrank's
    `cpu_decode.lowrank_encode`), so both turn by the same numbers."""
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(delta.device, torch.float32)
    return angles.cos(), angles.sin()


def rope_table(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., 2 * len(inv_freq)] of turning by `delta` [...] positions, in rotate-half order: a table
    built once serves every vector turned by the same deltas (`turn`)."""
    cos, sin = rope_turns(delta, inv_freq)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` [..., D] by a `rope_table` [..., rot] that broadcasts against x's leading dims (the
    output takes the broadcast shape); channels past rot pass through (partial rotary models)."""
    rot = cos.shape[-1]
    head = x[..., :rot].float()
    half = rot // 2
    rotated_half = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    out = (head * cos + rotated_half * sin).to(x.dtype)
    return torch.cat([out, x[..., rot:].expand(*out.shape[:-1], -1)], dim=-1) if rot < x.shape[-1] else out


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate keys [B, H, T, D] by `delta` [B, H, T] positions (rotate-half RoPE, as in Llama-family models).

    Rotations compose, so a key rotated at position p and re-rotated by delta equals the key rotated at p + delta.
    Only the first 2 * len(inv_freq) channels carry RoPE (partial rotary models leave the rest alone).
    """
    return turn(keys, *rope_table(delta.to(keys.device), inv_freq))
