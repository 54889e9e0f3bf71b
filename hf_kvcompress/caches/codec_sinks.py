"""Exact attention sinks for lossy codecs: each row's first `codec.sink_tokens` real tokens, kept at full precision.

The first tokens draw much of every query's attention, so a lossy codec may keep them exactly beside its encoding
(IntactKV, arXiv:2403.01241); they are copied before anything is encoded or evicted and overwrite their decoded
slots whenever the store is read. Eviction moves slots, so the sinks' slot numbers
are a per-slot record (`slots.sink_slots`, slot_records.py) and follow it.
"""

from __future__ import annotations

import torch

from .layer_fields import LayerFields
from .storage import TokenStore


class CodecSinks(LayerFields):
    """CompressedLayer's exact sink tokens (a mixin): which slots they are (`slots.sink_slots` [B, H_kv, S], -1:
    none); their states [B, H_kv, S, D] are the store's `sink_keys` / `sink_values` (storage.py)."""

    def _capture_sinks(self) -> None:
        """Copy each row's first `codec.sink_tokens` real tokens before anything is encoded or evicted, while the
        tail still holds every token in order; real tokens not seen by then (a row still all padding) are not kept."""
        sinks = self.codec.sink_tokens
        if sinks == 0 or self.slots.sink_slots is not None or self.stored_tokens != self.seen:
            return
        # A token layer after its first step: sinks are captured before anything is encoded, evicted or ranked.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        offset = torch.arange(sinks, device=self.device)
        slots = torch.where(offset < self.padding.real_seen[:, None], self.padding.pads[:, None] + offset, -1)  # [B, S]
        slots = slots[:, None, :].expand(self.batch_size, self.kv_heads, sinks).contiguous()
        self.slots.sink_slots = slots
        self.store.capture_sinks(slots)
