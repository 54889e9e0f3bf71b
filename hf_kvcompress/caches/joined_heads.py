"""A lossless head store's pairs and recent tokens joined per head, with room, for its decode steps.

A head store (head_store.py) keeps each (row, KV head)'s pairs back to back in one flat tensor and the recent tokens
in a [B, H_kv, t, D] tail. A decode step that attends over each head's own pairs (`HeadStore.attend`) needs each
head's pairs followed by its tail as one tensor: joined by `torch.cat` at every step, that copied every pair the
layer holds at every step (what a DynamicCache's step copies too). Here the pairs and the tail of each head lie back
to back in one buffer per kind, followed by room for the tail to grow: attention reads each head as a view, and a
decode step writes its token into every head's room (one `index_copy_` per kind). The buffers are built once (a copy
of the pairs, the cost of one step's `cat`) and given back (`unjoin`, another copy) when the pairs change: when the
tail's oldest tokens join the pairs (`HeadStore.absorb`, every `ABSORB_BLOCK` steps), a row evicts, or anything reads
the pairs or the tail as tensors.

The room is the tail's growth until its next absorb, no more: the store then holds, from the join on, the bytes its
tail would hold at its longest (just before the absorb), which `HeadStore.promised_bytes` counts.
"""

from __future__ import annotations

import torch


class JoinedHeads:
    """Each (row, KV head)'s pairs, then its `tail` recent tokens, then room for `capacity - tail` more: one
    [sum over heads of (pairs + capacity), D] buffer per kind, head after head in (row, head) order.

    `counts`: pairs per head (on the host, read when the pairs last changed); `starts`: each head's first row;
    `next_rows` [B * H_kv] (int64, on the device): the row each head's next token goes to."""

    def __init__(self, pairs: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                 tail: tuple[torch.Tensor, torch.Tensor] | None, capacity: int, rows: int):
        """`pairs`: (keys, values), each head's [n, D] pairs in (row, head) order, `rows` rows of heads; `tail`:
        (keys, values) [B, H_kv, t, D] (None: no recent token); `capacity`: recent tokens each head has room for
        (>= t)."""
        keys = pairs[0]
        self.counts = [head.shape[0] for head in keys]
        self.tail = 0 if tail is None else tail[0].shape[2]
        self.capacity = capacity
        self.rows, self.heads = rows, len(keys) // rows
        self.buffers = tuple(
            self._join(heads, None if tail is None else tail[i].flatten(0, 1)) for i, heads in enumerate(pairs)
        )
        self.starts = [0]
        for count in self.counts[:-1]:
            self.starts.append(self.starts[-1] + count + capacity)
        first_free = [start + count + self.tail for start, count in zip(self.starts, self.counts, strict=True)]
        self.next_rows = torch.tensor(first_free, dtype=torch.long, device=self.buffers[0].device)

    def _join(self, heads: tuple[torch.Tensor, ...], tail: torch.Tensor | None) -> torch.Tensor:
        """[pairs, tail, room] of every head as one buffer, in one copy."""
        first = heads[0]
        room = first.new_empty(self.capacity - self.tail, *first.shape[1:])
        pieces = []
        for i, head in enumerate(heads):
            pieces += [head, room] if tail is None else [head, tail[i], room]
        return torch.cat(pieces)

    @property
    def has_room(self) -> bool:
        return self.tail < self.capacity

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a decode step's keys and values [B, H_kv, 1, D] after each head's tail (`has_room`)."""
        for buffer, states in zip(self.buffers, (keys, values), strict=True):
            buffer.index_copy_(0, self.next_rows, states.reshape(-1, states.shape[-1]))
        self.next_rows += 1
        self.tail += 1

    def views(self, kind: int) -> list[torch.Tensor]:
        """Each head's pairs followed by its tail, [n + t, D] views of buffer `kind` (0: keys, 1: values)."""
        buffer, tail = self.buffers[kind], self.tail
        return [buffer[start : start + count + tail] for start, count in zip(self.starts, self.counts, strict=True)]

    def unjoin(self, kind: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Buffer `kind`'s pairs as one flat [N, D] tensor (heads back to back, as `RaggedHeads` keeps them) and its
        tail as [B, H_kv, t, D] (None when t is 0), both fresh tensors."""
        buffer, tail = self.buffers[kind], self.tail
        heads = list(zip(self.starts, self.counts, strict=True))
        pairs = torch.cat([buffer[start : start + count] for start, count in heads])
        if tail == 0:
            return pairs, None
        recent = torch.stack([buffer[start + count : start + count + tail] for start, count in heads])
        return pairs, recent.view(self.rows, self.heads, tail, buffer.shape[-1])
