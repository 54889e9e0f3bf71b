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

Heads whose pairs are equal in number, or close (`group_heads`), are laid out at one stride, each right-aligned
after a gap of zeros that makes it as long as the group's widest: the group is then one strided [n, 1, m + t, D] view
of the buffer and one SDPA call (`attend`), with a mask of the gaps when there are any, where one call per (row, KV
head) made 24 calls per layer and step at batch 8 on SmolLM2 (what groups save and cost: docs/speed.md, "Per-head
stores in groups").

The room is the tail's growth until its next absorb, no more: the store then holds, from the join on, the bytes its
tail would hold at its longest (just before the absorb), plus the groups' gaps, masks and order (`layout_bytes`),
which `HeadStore.promised_bytes` counts.
"""

from __future__ import annotations

import torch

# A head joins a group when the group's widest head holds at most 1/GROUP_SLACK of a slot (its pairs plus the
# tail's capacity) more pairs than it: the gaps cost at most that share of the group's rows in bytes and reads, and a
# call saved is worth only a few hundred keys' reads on CPU, so heads far apart stay apart.
GROUP_SLACK = 32


def group_heads(counts: list[int], capacity: int, slack: float = GROUP_SLACK) -> list[list[int]]:
    """Heads (indices of `counts`, pairs per head) grouped to be attended together: widest first, a head joins the
    group being formed while the group's widest holds at most (widest + `capacity`) / `slack` pairs more than it
    (equal heads always share a group; `slack` 0: every head in one group).
    Groups are ordered by their first head, heads within a group by index; all alone, the order is the heads'."""
    groups: list[list[int]] = []
    widest = 0
    for head in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        if groups and (counts[head] == widest or (widest - counts[head]) * slack <= widest + capacity):
            groups[-1].append(head)
        else:
            groups.append([head])
            widest = counts[head]
    return sorted((sorted(group) for group in groups), key=lambda group: group[0])


class JoinedHeads:
    """Each (row, KV head)'s pairs, then its `tail` recent tokens, then room for `capacity - tail` more, the heads of
    a group (`group_heads`) at one stride with a gap of zeros before each head's pairs: one buffer per kind.

    `counts`: pairs per head (on the host, read when the pairs last changed); `starts`: each head's first pair's row;
    `next_rows` [B * H_kv] (int64, on the device): the row each head's next token goes to; `groups`: the heads of
    each group (flat (row, head) indices); `order` / `inverse` [B * H_kv] (int64): the heads in group order and back,
    None when that is the heads' own order; `masks`: each group's [n, 1, 1, widest + capacity] bool of the slots that
    hold a pair or a recent token (None: no gap in the group)."""

    def __init__(self, pairs: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                 tail: tuple[torch.Tensor, torch.Tensor] | None, capacity: int, rows: int,
                 slack: float | None = None):
        """`pairs`: (keys, values), each head's [n, D] pairs in (row, head) order, `rows` rows of heads; `tail`:
        (keys, values) [B, H_kv, t, D] (None: no recent token); `capacity`: recent tokens each head has room for
        (>= t); `slack`: as `group_heads`' (None: `GROUP_SLACK`)."""
        keys = pairs[0]
        self.counts = [head.shape[0] for head in keys]
        self.tail = 0 if tail is None else tail[0].shape[2]
        self.capacity = capacity
        self.rows, self.heads = rows, len(keys) // rows
        self.groups = group_heads(self.counts, capacity, GROUP_SLACK if slack is None else slack)
        self.widths = [max(self.counts[i] for i in group) for group in self.groups]  # each group's widest pairs
        self.starts = [0] * len(self.counts)
        self.bases = []  # each group's first row
        row = 0
        for group, widest in zip(self.groups, self.widths, strict=True):
            self.bases.append(row)
            for head in group:
                self.starts[head] = row + widest - self.counts[head]
                row += widest + capacity
        self.gaps = sum(widest - self.counts[i] for group, widest in zip(self.groups, self.widths, strict=True)
                        for i in group)  # rows of zeros, per kind
        self.buffers = tuple(
            self._join(heads, None if tail is None else tail[i].flatten(0, 1)) for i, heads in enumerate(pairs)
        )
        device = self.buffers[0].device
        first_free = [start + count + self.tail for start, count in zip(self.starts, self.counts, strict=True)]
        self.next_rows = torch.tensor(first_free, dtype=torch.long, device=device)
        flat = [head for group in self.groups for head in group]
        self.order = self.inverse = None
        if flat != list(range(len(flat))):
            self.order = torch.tensor(flat, dtype=torch.long, device=device)
            self.inverse = torch.argsort(self.order)
        self.masks = [self._mask(group, widest) for group, widest in zip(self.groups, self.widths, strict=True)]

    def _mask(self, group: list[int], widest: int) -> torch.Tensor | None:
        """[n, 1, 1, widest + capacity] bool: the group's slots past each head's gap (None: no head has one)."""
        gaps = [widest - self.counts[i] for i in group]
        if not any(gaps):
            return None
        slot = torch.arange(widest + self.capacity, device=self.buffers[0].device)
        return (slot >= torch.tensor(gaps, device=slot.device)[:, None]).view(len(group), 1, 1, -1)

    def _join(self, heads: tuple[torch.Tensor, ...], tail: torch.Tensor | None) -> torch.Tensor:
        """[gap, pairs, tail, room] of every head, group after group, as one buffer, in one copy."""
        first = heads[0]
        room = first.new_empty(self.capacity - self.tail, *first.shape[1:])
        zeros = first.new_zeros(max(self.widths, default=0), *first.shape[1:])
        pieces = []
        for group, widest in zip(self.groups, self.widths, strict=True):
            for i in group:
                if self.counts[i] < widest:
                    pieces.append(zeros[: widest - self.counts[i]])
                pieces += [heads[i], room] if tail is None else [heads[i], tail[i], room]
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

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of each head's queries `query` [B * H_kv, 1, groups, D] (in (row, head) order) over its pairs
        and tail: [B * H_kv, 1, groups, Dv]. One SDPA call per group over a strided view of its heads, gaps masked
        (they hold zeros: no NaN reaches the masked product). Reads nothing on the host."""
        if self.order is not None:
            query = query.index_select(0, self.order)
        out, first = [], 0
        for group, widest, base, mask in zip(self.groups, self.widths, self.bases, self.masks, strict=True):
            n, width, stride = len(group), widest + self.tail, widest + self.capacity
            keys, values = (buffer[base : base + n * stride].view(n, 1, stride, -1)[:, :, :width]
                            for buffer in self.buffers)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query[first : first + n], keys, values, attn_mask=None if mask is None else mask[..., :width],
                scale=scaling,
            ))
            first += n
        joined = torch.cat(out) if len(out) > 1 else out[0]
        return joined if self.inverse is None else joined.index_select(0, self.inverse)

    def layout_bytes(self, width: int) -> int:
        """Bytes held beside the heads' pairs and their tails' room, `width` bytes per row of both kinds: the gaps,
        `next_rows`, the groups' order and masks."""
        masks = sum(mask.numel() for mask in self.masks if mask is not None)
        order = 0 if self.order is None else 2 * self.order.numel() * 8
        return self.gaps * width + len(self.counts) * 8 + order + masks

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
