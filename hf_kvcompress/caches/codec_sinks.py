"""Exact attention sinks for lossy codecs: each row's first `codec.exact_sinks` real tokens, kept exact.

The first tokens draw much of every query's attention, so a lossy codec may keep them exactly beside its encoding
(IntactKV, arXiv:2403.01241); they are copied before anything is encoded or evicted and overwrite their decoded
slots whenever the store is read. Eviction moves slots, so the sinks' slot numbers are a per-slot record
(`slots.sink_slots`, slot_records.py) and follow it; their states are the store's `sink_keys` / `sink_values`
(storage.py).
"""

from __future__ import annotations

import torch

from .padding import RowPadding


def first_real_slots(sinks: int, padding: RowPadding, heads: int) -> torch.Tensor:
    """The slots of each row's first `sinks` real tokens, [B, H_kv, sinks] (-1: a real token not seen yet, as in a
    row still all padding), while the slots still hold every token seen, in order."""
    offset = torch.arange(sinks, device=padding.pads.device)
    slots = torch.where(offset < padding.real_seen[:, None], padding.pads[:, None] + offset, -1)  # [B, S]
    return slots[:, None, :].expand(slots.shape[0], heads, sinks).contiguous()
