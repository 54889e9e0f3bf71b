"""StreamingLLM's re-rotation: kept keys are re-rotated after each eviction so that their distance to the next
query is their distance in the cache, which keeps streams longer than the trained context in RoPE's range.

Needs full-precision keys (they are rotated in place) and the RoPE frequencies (`inv_freq`); the position each kept
key is rotated to is tracked per slot, also for policies that score by position (`policy.needs_positions`).
"""

from __future__ import annotations

import torch

from .layer_fields import LayerFields
from .storage import TokenStore


class Rerotation(LayerFields):
    """CompressedLayer's key positions (a mixin): `positions` [B, H_kv, T], the position each kept key is
    rotated to."""

    def _track_positions(self, attn_kwargs: dict | None, new: int) -> None:
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2:
            start = self.seen - new
            position_ids = torch.arange(start, start + new, device=self.device)[None, :]
        fresh = position_ids.to(self.device, torch.int32)[:, None, :].expand(self.batch_size, self.kv_heads, new)
        self.slots.append("positions", fresh)

    def _rerotate_kept(self) -> None:
        """Re-rotate kept keys so slot i sits len(kept) - i positions before the row's next query."""
        # Called after an eviction of a re-rotating layer (`inv_freq` set), which tracks every slot's position and
        # is never ranked into a head store (budgets=head refuses rerotate).
        positions, inv_freq = self.slots.positions, self.inv_freq
        assert positions is not None and inv_freq is not None
        assert isinstance(self.store, TokenStore) and self.padding is not None
        kept = positions.shape[-1]
        target = self.padding.real_seen[:, None, None] - kept + torch.arange(kept, device=self.device)
        self.store.rotate_tail_keys(target - positions, inv_freq)
        self.slots.positions = target.to(torch.int32).expand_as(positions).contiguous()
