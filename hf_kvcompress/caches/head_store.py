"""Per-head budgets that really free memory: each (row, KV head) stores its own number of pairs, back to back.

A global ranking (KVzip, Ada-KV) gives some heads many pairs and others few. Kept as [B, H, T] tensors, every head
would hold slots for the most any head keeps; here the pairs of row 0 head 0, row 0 head 1, ... are concatenated
(oldest first within a head) and only `lengths` [B, H] says where each head's pairs are. Attention gets a padded
[B, H, M, D] view built for the step (M: the most pairs any head keeps), with each head's pairs right-aligned and a
mask of the slots that hold a pair; the view is transient. Each head's pairs are one contiguous slice of the store,
so the view is one `torch.cat` of [zeros, head's pairs] pieces (the zeros one expanded row): a single copy, with the
per-head lengths read to the host only when the pairs change (evicting, appending), not at every step.
"""

from __future__ import annotations

import torch

from ..codecs.base import Codec, Encoded, Kind, _index_op


class RaggedHeads:
    """Encoded pairs of every (row, KV head), a different number per head, with the score each pair was kept by."""

    def __init__(self, keys: Encoded, values: Encoded, scores: torch.Tensor, lengths: torch.Tensor):
        self.keys = keys  # name -> [N, ...]: the codec's encoded tensors with (row, head, token) flattened
        self.values = values
        self.scores = scores  # [N] float32: lower goes first (+inf: never)
        self.lengths = lengths  # [B, H] int64: pairs held per row and head
        self._changed()

    def _changed(self) -> None:
        """Forget what the views were assembled from: the pairs were evicted, appended or reordered."""
        self.most = int(self.lengths.max()) if self.lengths.numel() else 0  # the padded view's width, on the host
        self._counts: list[int] | None = None  # `lengths` flattened, on the host (no tensor: bytes stay exact)

    @classmethod
    def pack(cls, keys: Encoded, values: Encoded, scores: torch.Tensor, keep: torch.Tensor) -> "RaggedHeads":
        """The pairs `keep` [B, H, T] (bool) of token-wise encodings whose tensors are [B, H, T, ...]."""
        heads = keep.shape[1]
        for name, tensor in [*keys.items(), *values.items()]:
            if tensor.shape[:3] != keep.shape:
                raise ValueError(
                    f"per-head budgets need one encoded entry per (row, KV head, token): {name} has shape "
                    f"{tuple(tensor.shape)} for {heads} KV heads and {keep.shape[-1]} tokens (a codec that shares "
                    "heads or groups tokens cannot keep a different number of pairs per head)"
                )
        return cls(_select(keys, keep), _select(values, keep), scores[keep].float(), keep.sum(-1))

    @property
    def pairs(self) -> int:
        return int(self.scores.shape[0])

    def row_pairs(self) -> torch.Tensor:
        """Pairs held per row, [B]."""
        return self.lengths.sum(-1)

    def _head_counts(self) -> list[int]:
        """`lengths` flattened, read to the host once per change of the pairs rather than at every view."""
        if self._counts is None:
            self._counts = self.lengths.flatten().tolist()
        return self._counts

    def padded(self, codec: Codec, kind: Kind, dtype: torch.dtype, after: Encoded | None = None) -> torch.Tensor:
        """The decoded [B, H, M, D] view; slots that hold no pair decode from zeros and must be masked (`valid`).
        `after` (encoded [B, H, t, ...]) joins each head's pairs before decoding: [B, H, M + t, D] in one copy."""
        batch, heads = self.lengths.shape
        counts = self._head_counts()
        encoded = {}
        for name, tensor in (self.keys if kind == "key" else self.values).items():

            def assemble(t, name=name):
                later = None if after is None else after[name].view(t.dtype).flatten(0, 1).unbind(0)
                zeros = t.new_zeros(1, *t.shape[1:]).expand(self.most - min(counts, default=0), *t.shape[1:])
                pieces = []
                for i, pairs in enumerate(t.split(counts)):
                    pieces += [zeros[: self.most - counts[i]], pairs] if counts[i] < self.most else [pairs]
                    if later is not None:
                        pieces.append(later[i])
                width = self.most + (0 if after is None else after[name].shape[2])
                joined = torch.cat(pieces) if pieces else t[:0]  # no rows at all
                return joined.view(batch, heads, width, *t.shape[1:])

            encoded[name] = _index_op(tensor, assemble)
        return codec.decode(encoded, kind, dtype)

    def valid(self) -> torch.Tensor:
        """[B, H, M] bool: the view's slots that hold a pair."""
        slot = torch.arange(self.most, device=self.lengths.device)
        return slot >= (self.most - self.lengths)[..., None]

    def evictable(self) -> torch.Tensor:
        """Pairs per row that may be evicted (finite score), [B]."""
        batch, heads = self.lengths.shape
        row = torch.repeat_interleave(torch.arange(batch, device=self.lengths.device), self.row_pairs())
        return torch.zeros(batch, dtype=torch.long, device=row.device).index_add_(
            0, row, torch.isfinite(self.scores).long()
        )

    def evict_lowest(self, count: list[int]) -> None:
        """Drop each row's `count[b]` lowest-scored pairs, whatever head holds them (ties: the head and token
        stored first go first); pairs scored +inf are never dropped."""
        if not any(count):
            return
        batch, heads = self.lengths.shape
        keep = torch.ones(self.pairs, dtype=torch.bool, device=self.scores.device)
        start = 0
        for b, n_row in enumerate(self.row_pairs().tolist()):
            segment = self.scores[start : start + n_row]
            k = min(count[b], int(torch.isfinite(segment).sum()))
            if k > 0:
                lowest = torch.sort(segment, stable=True).indices[:k]
                keep[start + lowest] = False
            start += n_row
        head = torch.repeat_interleave(torch.arange(batch * heads, device=keep.device), self.lengths.flatten())
        dropped = torch.bincount(head[~keep], minlength=batch * heads).view(batch, heads)
        self.keys = {n: _index_op(t, lambda x: x[keep]) for n, t in self.keys.items()}
        self.values = {n: _index_op(t, lambda x: x[keep]) for n, t in self.values.items()}
        self.scores = self.scores[keep]
        self.lengths = self.lengths - dropped
        self._changed()

    def append(self, keys: Encoded, values: Encoded, scores: torch.Tensor, keep: torch.Tensor) -> None:
        """Add the newer pairs `keep` [B, H, t] (bool) of encoded tensors [B, H, t, ...] scored [B, H, t] after
        each head's pairs."""
        batch, heads, new = scores.shape
        counts = self.lengths.flatten()
        added = keep.flatten(0, 1).sum(-1)  # [B * H]
        grown = counts + added
        start = grown.cumsum(0) - grown
        head = torch.repeat_interleave(torch.arange(batch * heads, device=counts.device), counts)
        old_rank = torch.arange(head.numel(), device=counts.device) - (counts.cumsum(0) - counts)[head]
        old_to = start[head] + old_rank
        rank = keep.flatten(0, 1).long().cumsum(-1) - 1  # [B * H, t]: each kept new pair's rank among them
        new_to = ((start + counts)[:, None] + rank)[keep.flatten(0, 1)]
        total = int(grown.sum())
        flat_keep = keep.reshape(-1)

        def merge(old, fresh):
            out = old.new_empty(total, *old.shape[1:])
            out.index_copy_(0, old_to, old)
            return out.index_copy_(0, new_to, fresh.reshape(batch * heads * new, *old.shape[1:])[flat_keep])

        self.keys = {n: _index_op(t, lambda x, n=n: merge(x, keys[n].view(x.dtype))) for n, t in self.keys.items()}
        self.values = {
            n: _index_op(t, lambda x, n=n: merge(x, values[n].view(x.dtype))) for n, t in self.values.items()
        }
        self.scores = merge(self.scores, scores.float())
        self.lengths = self.lengths + added.view(batch, heads)
        self._changed()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (beam search reorders and repeats them)."""
        per_row = self.row_pairs()
        starts = per_row.cumsum(0) - per_row
        index = torch.cat([
            torch.arange(int(starts[r]), int(starts[r] + per_row[r]), device=per_row.device) for r in rows.tolist()
        ])
        self.keys = {n: _index_op(t, lambda x: x.index_select(0, index)) for n, t in self.keys.items()}
        self.values = {n: _index_op(t, lambda x: x.index_select(0, index)) for n, t in self.values.items()}
        self.scores = self.scores.index_select(0, index)
        self.lengths = self.lengths.index_select(0, rows)
        self._changed()

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that rebuild this store (`from_state`)."""
        tensors = {"scores": self.scores, "lengths": self.lengths}
        tensors.update({f"key.{n}": t for n, t in self.keys.items()})
        tensors.update({f"value.{n}": t for n, t in self.values.items()})
        return tensors

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor]) -> "RaggedHeads":
        keys = {n[len("key."):]: t for n, t in tensors.items() if n.startswith("key.")}
        values = {n[len("value."):]: t for n, t in tensors.items() if n.startswith("value.")}
        return cls(keys, values, tensors["scores"], tensors["lengths"])


def evict_lowest_across(stores: list[RaggedHeads], count: list[int]) -> None:
    """Drop each row's `count[b]` lowest-scored pairs of all `stores` together (the same rows and heads in each;
    ties: the store listed first goes first, then as `evict_lowest`)."""
    if len(stores) == 1:
        stores[0].evict_lowest(count)
        return
    taken = [[0] * len(count) for _ in stores]
    per_row = [store.row_pairs().tolist() for store in stores]
    starts = [0] * len(stores)
    for b, k in enumerate(count):
        segments = [store.scores[start : start + pairs[b]] for store, start, pairs in zip(stores, starts, per_row)]
        starts = [start + pairs[b] for start, pairs in zip(starts, per_row)]
        if k <= 0:
            continue
        joined = torch.cat(segments)
        owner = torch.cat([torch.full((len(seg),), i, device=joined.device) for i, seg in enumerate(segments)])
        k = min(k, int(torch.isfinite(joined).sum()))
        lowest = torch.sort(joined, stable=True).indices[:k]
        for i, n in enumerate(torch.bincount(owner[lowest], minlength=len(stores)).tolist()):
            taken[i][b] = n
    for store, n in zip(stores, taken):
        store.evict_lowest(n)


def _select(encoded: Encoded, keep: torch.Tensor) -> Encoded:
    return {name: _index_op(tensor, lambda t: t[keep].contiguous()) for name, tensor in encoded.items()}
