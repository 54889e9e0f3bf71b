"""StreamingLLM's re-rotation: kept keys are re-rotated after each eviction so that their distance to the next
query is their distance in the cache, which keeps streams longer than the trained context in RoPE's range.

Needs full-precision keys (they are rotated in place) and the RoPE frequencies (`inv_freq`); the position each kept
key is rotated to is tracked per slot (`SlotRecords.positions`, [B, H_kv, T]), also for policies that score by
position (`policy.needs_positions`).
"""

from __future__ import annotations

import torch

from .slot_records import SlotRecords
from .storage import TokenStore


def step_positions(attn_kwargs: dict | None, first: int, new: int, batch: int, heads: int, device) -> torch.Tensor:
    """The positions of a step's `new` keys, [B, H_kv, new] int32: the model's `position_ids` when it passes per-row
    ones, else `first, first + 1, ...` (`first`: the tokens the layer had seen before the step)."""
    position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
    if position_ids is None or position_ids.dim() != 2:
        position_ids = torch.arange(first, first + new, device=device)[None, :]
    # owned, not an expanded view: the record's bytes are what it holds
    return position_ids.to(device, torch.int32)[:, None, :].expand(batch, heads, new).contiguous()


def rerotate_kept(store: TokenStore, slots: SlotRecords, real_seen: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Re-rotate the kept keys (all in the store's full-precision tail) so slot i sits len(kept) - i positions before
    the row's next query, and record the positions they now have."""
    positions = slots.positions
    assert positions is not None  # a re-rotating layer tracks every slot's position
    kept = positions.shape[-1]
    target = real_seen[:, None, None] - kept + torch.arange(kept, device=positions.device)
    store.rotate_tail_keys(target - positions, inv_freq)
    slots.positions = target.to(torch.int32).expand_as(positions).contiguous()
