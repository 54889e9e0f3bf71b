"""Exact attention sinks for lossy codecs: each row's first `codec.exact_sinks` real tokens, kept exact, and the
outliers (`codec.exact_outliers`: the share of each encoded block that the codec reads back worst).

The first tokens draw much of every query's attention, so a lossy codec may keep them exactly beside its encoding
(IntactKV, arXiv:2403.01241); they are copied before anything is encoded or evicted and overwrite their decoded
slots whenever the store is read. Eviction moves slots, so the sinks' slot numbers are a per-slot record
(`slots.sink_slots`, slot_records.py) and follow it; their states are the store's `sink_keys` / `sink_values`
(storage.py). Outliers are chosen from each block of tokens as it is encoded (`worst_slots`) and join the sinks'
records after them: the store and attention read every such slot alike, wherever it lies.
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


def worst_slots(errors: torch.Tensor, count: int, start: int, pads: torch.Tensor, sinks: torch.Tensor | None,
                heads: int) -> torch.Tensor:
    """The `count` slots of a block that `errors` [B, n] (the codec's `token_errors` of slots start .. start + n - 1)
    ranks worst in each row, padding and sinks (`sinks` [B, H_kv, S] slot numbers, -1: none) left out, as
    [B, H_kv, count] slot numbers counted from `start` (-1 where a row has fewer real tokens), in slot order."""
    batch, n = errors.shape
    slot = torch.arange(start, start + n, device=errors.device)
    eligible = slot[None, :] >= pads[:, None]  # [B, n]: padding holds each row's first slots
    if sinks is not None:
        inside = (sinks[:, 0] >= start) & (sinks[:, 0] < start + n)  # a sink's slot is the same in every head
        hit = torch.zeros(batch, n + 1, dtype=torch.bool, device=errors.device)
        hit.scatter_(1, torch.where(inside, sinks[:, 0] - start, n), True)
        eligible &= ~hit[:, :n]
    scores = errors.float().masked_fill(~eligible, float("-inf"))
    top = scores.topk(min(count, n), dim=-1)
    picked = torch.where(torch.isfinite(top.values), top.indices, n).sort(dim=-1).values  # n: none, sorted last
    picked = picked.masked_fill(picked == n, -1)
    return picked[:, None, :].expand(batch, heads, picked.shape[-1]).contiguous()
