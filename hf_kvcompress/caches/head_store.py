"""Per-head budgets that really free memory: each (row, KV head) stores its own number of pairs, back to back.

A global ranking (KVzip, Ada-KV) gives some heads many pairs and others few. Kept as [B, H, T] tensors, every head
would hold slots for the most any head keeps; here the pairs of row 0 head 0, row 0 head 1, ... are concatenated
(oldest first within a head) and only `lengths` [B, H] says where each head's pairs are. Attention gets a padded
[B, H, M, D] view built for the step (M: the most pairs any head keeps), with each head's pairs right-aligned and a
mask of the slots that hold a pair; the view is transient. Each head's pairs are one contiguous slice of the store,
so the view is one `torch.cat` of [zeros, head's pairs] pieces (the zeros one expanded row): a single copy, with the
per-head lengths read to the host only when the pairs change (evicting, appending), not at every step. A decode
step of a lossless store needs no view at all: each head's pairs are attended as they lie, joined with that head's
recent tokens in a buffer with room (`HeadStore.attend`, joined_heads.py), as a cache holding only them would, heads
of close lengths laid out to share one attention call. A decode step of a lossy store the C++ kernel reads (int2,
int4, int8, fp8 on CPU) needs no view either: the kernel reads each head's encoded pairs where they lie, given each
head's first pair and count (`RaggedHeads.spans`, `HeadStore.attend_encoded`), with the codec's exact sinks, the exact
pairs and the tail as its full-precision segment. The view serves the rest: GPUs, no compiler, prompt chunks.

`HeadStore` is the store of a layer after KVzip's global ranking (`CompressedLayer.rank_heads`): the kept pairs in
`RaggedHeads`, the context's pairs still within the codec's residual in a second one (full precision), the tokens
since the ranking in a full-precision tail, and the codec's exact sinks, with the interface `TokenStore`
(storage.py) offers the layer.
"""

from __future__ import annotations

from itertools import accumulate
from typing import cast

import torch

from ..codecs.base import Codec, Encoded, Kind, index_op
from ..codecs.identity import IdentityCodec
from ..ops import cpu_decode
from ..policies.base import Policy
from .joined_heads import JoinedHeads
from .storage import TokenStore
from .store_attention import attend_by_cpu_kernel, kernel_layouts

LATER_TOKENS = 2.0  # scores of tokens after the ranking start here: above any attention probability
ABSORB_BLOCK = 32  # recent tokens beyond the codec's residual join the store this many at a time
# Pairs per KV head a row over its allowance gives up beyond the excess (at most an eighth of the allowance, so a
# small budget is not emptied). Each decoded token adds a pair per head while a ratio's allowance grows by a fraction
# of one, so evicting only the excess sorted and copied the whole store on nearly every step; with this slack a
# row evicts once every ~EVICTION_SLACK / (1 - ratio) tokens, and still never holds more than its allowance.
EVICTION_SLACK = 32
SLACK_SHARE = 8
EXACT = IdentityCodec()  # how the context's pairs within the codec's residual are stored: as they are


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
        self._spans: list[tuple[int, int]] | None = None  # (first pair, pairs) of each head, on the host (`spans`)

    @classmethod
    def pack(cls, keys: Encoded, values: Encoded, scores: torch.Tensor, keep: torch.Tensor) -> RaggedHeads:
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

            encoded[name] = index_op(tensor, assemble)
        return codec.decode(encoded, kind, dtype)

    def spans(self) -> torch.Tensor:
        """[B, H, 2] int64: each (row, head)'s first pair in the flat tensors and its number of pairs, as the C++
        kernel reads the pairs where they lie (ops/cpu_decode.py `decode_attention`'s `spans`). Built for the step
        from numbers kept on the host since the pairs last changed: transient, so the store's bytes stay its pairs'."""
        if self._spans is None:
            counts = self._head_counts()
            self._spans = list(zip(accumulate(counts, initial=0), counts, strict=False))  # starts: one more
        batch, heads = self.lengths.shape
        return torch.tensor(self._spans, dtype=torch.long, device=self.lengths.device).view(batch, heads, 2)

    def heads(self, codec: Codec, kind: Kind, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Each (row, KV head)'s pairs decoded, [n, D] each, in (row, head) order. For a lossless codec (decoding
        gives the stored tensor back) these are views of the store: no copy, no padding."""
        stored = {name: tensor[None, None] for name, tensor in (self.keys if kind == "key" else self.values).items()}
        return codec.decode(stored, kind, dtype)[0, 0].split(self._head_counts())

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
        self.keys = {n: index_op(t, lambda x: x[keep]) for n, t in self.keys.items()}
        self.values = {n: index_op(t, lambda x: x[keep]) for n, t in self.values.items()}
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

        self.keys = {n: index_op(t, lambda x, n=n: merge(x, keys[n].view(x.dtype))) for n, t in self.keys.items()}
        self.values = {
            n: index_op(t, lambda x, n=n: merge(x, values[n].view(x.dtype))) for n, t in self.values.items()
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
        self.keys = {n: index_op(t, lambda x: x.index_select(0, index)) for n, t in self.keys.items()}
        self.values = {n: index_op(t, lambda x: x.index_select(0, index)) for n, t in self.values.items()}
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
    def from_state(cls, tensors: dict[str, torch.Tensor]) -> RaggedHeads:
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
        segments = [store.scores[start : start + pairs[b]]
                    for store, start, pairs in zip(stores, starts, per_row, strict=True)]
        starts = [start + pairs[b] for start, pairs in zip(starts, per_row, strict=True)]
        if k <= 0:
            continue
        joined = torch.cat(segments)
        owner = torch.cat([torch.full((len(seg),), i, device=joined.device) for i, seg in enumerate(segments)])
        k = min(k, int(torch.isfinite(joined).sum()))
        lowest = torch.sort(joined, stable=True).indices[:k]
        for i, n in enumerate(torch.bincount(owner[lowest], minlength=len(stores)).tolist()):
            taken[i][b] = n
    for store, n in zip(stores, taken, strict=True):
        store.evict_lowest(n)


class RankedTogether:
    """Head stores ranked together (one ranking of every layer's pairs, head_ranking.py) that hold one allowance per
    row while decoding, the sum of theirs at the ranking: the lowest-scored pairs of any of their layers and heads go
    first, as the ranking chose among all of them. Held per layer instead, a layer the ranking gave few pairs (Gemma-
    3-270M's layer 17: 139 of 3,072 under `kvzap:budget=1024`) filled its allowance with its newest `recent` decoded
    tokens and evicted every pair of the document, while the other layers kept generated pairs scored below
    document pairs of theirs (docs/results.md, "KVzap while decoding on Gemma-3: what the budget evicts").

    `stores`: in layer order; the last one holds the allowance after each step (`HeadStore.evict`), once every layer
    has appended and absorbed the step's tokens. `headroom`: as a store's, for all of them."""

    def __init__(self, stores: list[HeadStore]):
        self.stores = stores
        self.headroom: int | None = None
        for store in stores:
            store.together = self


def hold_allowance(stores: list[HeadStore], policy: Policy, holder) -> None:
    """Hold at most the rows' allowance over `stores` (the sum of their pairs at the ranking, moved since as the
    policy's share of the tokens seen moves: a ratio's, or a budget's until the row has seen that many): the
    lowest-scored stored pairs of any store and head go first (the context before later tokens), down to the
    allowance less the slack; a row whose pairs have nothing left to give drops just enough of its oldest recent
    tokens, as many from every store's tail.

    Each token adds one pair per head and an allowance never shrinks, so after a check no row can be over until the
    rows have added the smallest room left (`holder.headroom`, the store's or the group's): the steps between skip
    the check and its host read."""
    if holder.headroom is not None and holder.headroom >= 0:
        return
    if not policy.evicts_while_decoding:  # KVzip's decoding="append": later tokens are kept beyond the share
        return
    heads = sum(store.kv_heads for store in stores)
    first = stores[0]  # every store has seen the same tokens (`real_seen`, `share_then`)
    held = cast(torch.Tensor, sum(store.held_pairs() for store in stores))  # [B]: a sum of >= 1 tensors
    allowance = (cast(torch.Tensor, sum(store.allowance for store in stores))
                 + heads * (policy.held_per_row(first.real_seen) - first.share_then))
    over = (held - allowance).clamp(min=0)
    if not bool((over > 0).any()):
        holder.headroom = int((allowance - held).min())
        return
    slack = torch.where(over > 0, (allowance // SLACK_SHARE).clamp(max=EVICTION_SLACK * heads), 0)
    parts = [part for store in stores for part in ([store.encoded] if store.exact is None
                                                   else [store.encoded, store.exact])]
    evictable = cast(torch.Tensor, sum(part.evictable() for part in parts))  # [B]
    from_store = torch.minimum(over + slack, evictable)
    evict_lowest_across(parts, from_store.tolist())
    rest = (over - from_store).clamp(min=0)  # the slack comes from the stored pairs only, never from recent tokens
    if bool((rest > 0).any()):
        tokens = (rest + heads - 1) // heads  # whole tokens of every store's tail: every head of the row
        for store in stores:
            if store.tail_valid is not None:
                oldest = store.tail_valid & (store.tail_valid.long().cumsum(-1) <= tokens[:, None])
                store.tail_valid = store.tail_valid & ~oldest
                store.tail_dropped = True
    held = cast(torch.Tensor, sum(store.held_pairs() for store in stores))
    holder.headroom = int((allowance - held).min())


def head_store_counts(kv_heads: int, sinks: int) -> int:
    """Bytes per row of a head store's counts (`promised_bytes`) beside its pairs: an int64 length per KV head for
    the encoded and for the exact pairs, the row's real_seen, allowance and share_then (int64), one flag per
    codec sink (`sink_valid`). What KVzip's `bytes=` sets aside before buying pairs (plan.py `ByteTarget`)."""
    return 2 * kv_heads * 8 + 3 * 8 + sinks


def _select(encoded: Encoded, keep: torch.Tensor) -> Encoded:
    return {name: index_op(tensor, lambda t: t[keep].contiguous()) for name, tensor in encoded.items()}


class HeadStore:
    """A layer's stored states once each KV head keeps its own number of context pairs (KVzip's head budgets).

    `encoded` (`RaggedHeads`): the kept pairs at the codec's rate, each with the score it was kept by; `exact`
    (`RaggedHeads` or None): the context's kept pairs that were still within the codec's residual at the ranking, at
    full precision until later tokens fill the residual (`absorb`); `tail_keys` / `tail_values` [B, H_kv, t, D]: the
    tokens since the ranking, full precision, `tail_valid` [B, t] (False once a row evicted the token) and
    `tail_scores` [B, H_kv, t] (float32, only when a scorer scores them: KVzap's probe);
    `sink_keys` / `sink_values` [B, H_kv, S, D] and `sink_valid` [B, S]: the codec's exact sinks, beside the store;
    `real_seen` [B]: real tokens each row has seen (padding only ever leads a row's prompt, and no padding pair is
    kept); `allowance` [B]: the pairs a row held at the ranking, its share of the total, and `share_then` [B]: the
    policy's share of the tokens seen then (`evict` moves the allowance with it).

    Tokens since the ranking rank above the context (newest first), or by their own scores when they have them (once
    they leave the tail, which then holds the policy's `recent` newest); when a row holds more than its allowance the
    lowest-scored pairs of any head go, the context's first, a block at a time: down to the allowance less some slack
    (`EVICTION_SLACK`), so that eviction runs every few dozen steps instead of nearly every step; the row never holds
    more than its allowance after a step. Attention reads [sinks | padded encoded view | padded exact view | tail]
    with the per-head `mask`, through 'kvcompress_sdpa' (`use_kvcompress_attention`): the reference, and what prompt
    chunks and stores without a faster decode step read (`attend`: `attends_by_head`, `attends_encoded`).
    """

    per_head = True  # heads hold different numbers of pairs: attention needs the layer's own, per-head mask
    KIND = "head_budgets"  # a saved layer's meta `kind` (persist.py): this store, under the names below
    # Saved (and reordered by batch row) under these names; the pairs as `store.*` and `exact.*`.
    TENSORS = ("tail_keys", "tail_values", "tail_valid", "tail_scores", "sink_keys", "sink_values", "sink_valid",
               "real_seen", "allowance", "share_then")
    # `TENSORS`, set in `__init__`: the tail's four are None while no token came since the ranking (or since
    # `absorb` took them all; `tail_scores` also when its tokens are not scored), the sinks' three without codec
    # sinks; the per-row counts are always held (`rank`, `from_state`). `tail_keys` and `tail_values` are
    # properties (below): while the pairs and the tail are joined for decode steps they are in `joined`.
    tail_valid: torch.Tensor | None
    tail_scores: torch.Tensor | None
    sink_keys: torch.Tensor | None
    sink_values: torch.Tensor | None
    sink_valid: torch.Tensor | None
    real_seen: torch.Tensor
    allowance: torch.Tensor
    share_then: torch.Tensor

    def __init__(self, codec: Codec, dtype: torch.dtype, encoded: RaggedHeads, exact: RaggedHeads | None,
                 **tensors: torch.Tensor | None):
        self.codec = codec
        self.dtype = dtype
        # The pairs; while `joined` is held their keys and values are in it, and `encoded` gives them back first.
        self._encoded = encoded
        # Each head's pairs and tail back to back with room, for decode steps over each head's own pairs (`attend`;
        # joined_heads.py); None: the pairs' keys and values are in `_encoded` and the tail in `_tail_keys` /
        # `_tail_values`.
        self.joined: JoinedHeads | None = None
        self._tail_keys: torch.Tensor | None = None
        self._tail_values: torch.Tensor | None = None
        self.exact = exact
        for name in self.TENSORS:
            setattr(self, name, tensors.get(name))
        self.headroom: int | None = None  # pairs every row may still add before one can be over (`hold_allowance`)
        # The stores ranked with this one, when they hold one allowance together (`RankedTogether`); None: its own.
        self.together: RankedTogether | None = None
        # Whether a row may have evicted some of the tail's tokens (`evict`): then only the masked view (`full`,
        # `mask`) says which tail slots hold a token. Known on the host, so that `attends_by_head` reads nothing.
        self.tail_dropped = self.tail_valid is not None and not bool(self.tail_valid.all())
        self._kernel: bool | None = None  # whether the C++ kernel reads the pairs here (`attends_encoded`), once known

    @classmethod
    def rank(
        cls, store: TokenStore, scores: torch.Tensor, keep: torch.Tensor, sink_slots: torch.Tensor | None,
        real_seen: torch.Tensor, policy: Policy, window_scores: torch.Tensor | None = None,
    ) -> HeadStore:
        """The pairs `keep` [B, H, T] (bool) of a token store's slots, scored `scores` [B, H, T]. `sink_slots`
        [B, H, S] (-1: none): the codec's exact sinks, captured in `store`, which stay exact beside the pairs.

        `window_scores` [B, H, T] (KVzap: the probe's estimates of every slot, as later tokens are scored): the
        prompt's `policy.recent` newest tokens start the tail instead of joining the pairs at the recent window's
        score (above every estimate, for good): protected while they are among the `recent` newest, they then
        join the pairs with their own span-pooled estimates when decoded tokens push them out, as a decoded token
        does (`absorb`). Pinned at the window's score, a budget's document end outlived the document's own facts
        while decoding (docs/results.md, "KVzap while decoding on Gemma-3: what the budget evicts"). Only under a
        lossless codec without codec sinks (the tail is full precision: a lossy codec's encoded window would be
        stored again at full precision); the policy's sinks stay in the pairs."""
        keep = keep.clone()
        window = None
        length = keep.shape[-1]
        recent = min(policy.recent, length)
        if window_scores is not None and store.codec.lossless and sink_slots is None and recent > 0:
            slot = torch.arange(length, device=keep.device)
            pads = (length - real_seen)[:, None]  # padding only ever leads a row
            window = (slot[None, :] >= length - recent) & (slot[None, :] >= pads + policy.sink_tokens)  # [B, T]
            keep &= ~window[:, None, :]
        sinks: dict[str, torch.Tensor | None] = {}
        if sink_slots is not None:  # the same for every head
            sinks = dict(sink_keys=store.sink_keys, sink_values=store.sink_values, sink_valid=sink_slots[:, 0] >= 0)
            if not bool(keep.gather(2, sink_slots.clamp(min=0))[sink_slots >= 0].all()):
                raise ValueError("the ranking evicted a codec sink token: its policy must protect them")
            keep.scatter_(2, sink_slots.clamp(min=0), False)
        codec = store.codec
        keys, values = store.encoded_whole("key"), store.encoded_whole("value")
        assert keys is not None and values is not None  # ranked after a reconstruction pass: the store holds tokens
        # Only what the token store has encoded enters the encoded pairs now; its tail (the context's newest tokens,
        # within the codec's residual) stays at full precision, as in every other layer, until `absorb`.
        split = keep.shape[-1] if codec.lossless else store.n_encoded
        encoded = keep.clone()
        encoded[..., split:] = False
        exact = None
        if split < keep.shape[-1]:
            assert store.tail_keys is not None and store.tail_values is not None  # slots past `split` are the tail's
            exact = RaggedHeads.pack(
                EXACT.encode(store.tail_keys, "key"), EXACT.encode(store.tail_values, "value"),
                scores[..., split:], keep[..., split:],
            )
        tail: dict[str, torch.Tensor | None] = {}
        if window is not None:
            assert window_scores is not None  # a window only with them
            start = length - recent
            tail = dict(tail_keys=codec.decode(keys, "key", store.dtype)[:, :, start:].clone(),
                        tail_values=codec.decode(values, "value", store.dtype)[:, :, start:].clone(),
                        tail_valid=window[:, start:].clone(),
                        tail_scores=window_scores[:, :, start:].to(torch.float32).clone())
        head = cls(codec, store.dtype, RaggedHeads.pack(keys, values, scores, encoded), exact,
                   real_seen=real_seen.clone(), **sinks, **tail)
        head.allowance = head.held_pairs()  # [B] pairs the row holds now: its share of the total
        head.share_then = policy.held_per_row(head.real_seen)
        return head

    # -- the pairs and the tail, joined or apart ----------------------------------------------------------------------

    @property
    def encoded(self) -> RaggedHeads:
        """The kept pairs (`RaggedHeads`), with their keys and values (given back by `joined` first, `settle`)."""
        self.settle()
        return self._encoded

    @property
    def tail_keys(self) -> torch.Tensor | None:
        """[B, H_kv, t, D]: the tokens since the ranking (given back by `joined` first, `settle`)."""
        self.settle()
        return self._tail_keys

    @tail_keys.setter
    def tail_keys(self, tensor: torch.Tensor | None) -> None:
        self.settle()
        self._tail_keys = tensor

    @property
    def tail_values(self) -> torch.Tensor | None:
        self.settle()
        return self._tail_values

    @tail_values.setter
    def tail_values(self, tensor: torch.Tensor | None) -> None:
        self.settle()
        self._tail_values = tensor

    def settle(self) -> None:
        """Give the pairs' keys and values back to `encoded` and the recent tokens back to the tail from `joined`
        (a copy of each), before anything reads or changes them apart."""
        joined, self.joined = self.joined, None
        if joined is None:
            return
        keys, self._tail_keys = joined.unjoin(0)
        values, self._tail_values = joined.unjoin(1)
        self._encoded.keys, self._encoded.values = self.codec.encode(keys, "key"), self.codec.encode(values, "value")

    def _join(self, policy: Policy) -> None:
        """Join each head's pairs and tail, with room for the tail to grow until `absorb` takes its oldest block
        (joined_heads.py); the pairs' keys and values and the tail are then held there only."""
        pairs = self._encoded
        heads = (pairs.heads(self.codec, "key", self.dtype), pairs.heads(self.codec, "value", self.dtype))
        tail = None
        if self._tail_keys is not None:
            assert self._tail_values is not None  # the tail's keys and values are held together
            tail = (self._tail_keys, self._tail_values)
        # `absorb` takes a block once the tail holds a block beyond what it keeps: the room never runs out before.
        kept = self._tail_kept(policy if self.tail_scores is not None else None)
        capacity = max(self.tail_tokens, kept + ABSORB_BLOCK)
        self.joined = JoinedHeads(heads, tail, capacity, self.real_seen.shape[0])
        empty: dict[str, torch.Tensor] = {}
        pairs.keys, pairs.values = empty, dict(empty)  # held by `joined` now (bytes counted once)
        self._tail_keys = self._tail_values = None

    def _tail_kept(self, policy: Policy | None) -> int:
        """Recent tokens `absorb` leaves in the tail: the codec's residual (and, with scored tokens, the `policy`'s
        `recent`)."""
        return max(self.codec.exact_residual, 0 if policy is None else policy.recent)

    # -- what the layer reads -----------------------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self._encoded.lengths.shape[1]

    @property
    def device(self) -> torch.device:
        return self.real_seen.device

    @property
    def stored_tokens(self) -> int:
        """Pairs held per KV head, on average over rows and heads (heads differ)."""
        return round(float(self.held_pairs().float().mean()) / self.kv_heads)

    @property
    def view_tokens(self) -> int:
        """Slots attention reads (`full`): the codec's sinks, the widest head's pairs of each part, the tail."""
        exact = 0 if self.exact is None else self.exact.most
        return self._sink_count() + self._encoded.most + exact + self.tail_tokens

    @property
    def tail_tokens(self) -> int:
        return 0 if self.tail_valid is None else self.tail_valid.shape[-1]  # a flag per recent token, joined or not

    def held_pairs(self) -> torch.Tensor:
        """Pairs each row holds, all heads together, [B]."""
        tail = 0 if self.tail_valid is None else self.tail_valid.sum(-1)
        exact = 0 if self.exact is None else self.exact.row_pairs()
        return self._encoded.row_pairs() + exact + self._sink_pairs() + tail * self.kv_heads

    def _sink_pairs(self):
        """The codec's exact sink pairs per row, all heads together ([B], or 0 without sinks)."""
        return 0 if self.sink_valid is None else self.sink_valid.sum(-1) * self.kv_heads

    def _sink_count(self) -> int:
        return 0 if self.sink_valid is None else self.sink_valid.shape[-1]

    # -- new tokens and what attention reads ----------------------------------------------------------------------

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """New states join the tail, as tokens every row keeps for now. `scores` [B, H_kv, new]: their scores,
        comparable with the ranked pairs' (KVzap's probe, scorers.py `later_scores`), which they keep when they join
        the pairs; None: they join above the ranked pairs, newest first."""
        batch, _, new, _ = key_states.shape
        holder = self if self.together is None else self.together
        if holder.headroom is not None:
            holder.headroom -= new * self.kv_heads
        self.real_seen = self.real_seen + new  # padding only ever leads a row's prompt
        if self.joined is not None and new == 1 and self.joined.has_room and self.attends_by_head:
            self.joined.append(key_states, value_states)  # in place, after each head's tail
        else:
            self._append_apart(key_states, value_states)
        fresh = torch.ones(batch, new, dtype=torch.bool, device=self.device)
        self.tail_valid = fresh if self.tail_valid is None else torch.cat([self.tail_valid, fresh], -1)
        if scores is not None:
            scores = scores.to(torch.float32)
            self.tail_scores = scores if self.tail_scores is None else torch.cat([self.tail_scores, scores], -1)

    def _append_apart(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New states join the tail tensors (`settle`d first when joined)."""
        self.tail_keys = key_states.clone() if self.tail_keys is None else torch.cat([self.tail_keys, key_states], -2)
        self.tail_values = (
            value_states.clone() if self.tail_values is None else torch.cat([self.tail_values, value_states], -2)
        )

    def full(self, kind: Kind, sink_slots: torch.Tensor | None = None) -> torch.Tensor:
        """What attention sees: [sinks | padded encoded view | padded exact view | tail] (slots that hold no pair
        are zeros, masked by `mask`). `sink_slots` is the token store's (a layer's slots): the sinks here sit first."""
        tail = self.tail_keys if kind == "key" else self.tail_values
        assert tail is not None  # the step's tokens joined the tail (`append`) before attention reads
        if self.codec.lossless and self.sink_valid is None:
            # A lossless codec gives the recent tokens back as they are: they join each head's pairs in the view's
            # one copy, instead of a second copy of the whole view by `cat`.
            return self.encoded.padded(self.codec, kind, self.dtype, after=self.codec.encode(tail, kind))
        parts = []
        if self.sink_valid is not None:
            sinks = self.sink_keys if kind == "key" else self.sink_values
            assert sinks is not None  # held with `sink_valid`
            parts.append(sinks.to(self.dtype))
        if self.encoded.most:
            parts.append(self.encoded.padded(self.codec, kind, self.dtype))
        if self.exact is not None and self.exact.most:
            parts.append(self.exact.padded(EXACT, kind, self.dtype))
        parts.append(tail)
        return torch.cat(parts, dim=-2)

    @property
    def attends_by_head(self) -> bool:
        """Whether a decode step can attend over each head's own pairs (`attend`) instead of the padded view and
        mask: the pairs are stored as they are (a lossless codec, so no exact part) and every pair of a head is
        visible to the step (no codec sinks beside them, no tail token evicted)."""
        return self.codec.lossless and self.sink_valid is None and self.exact is None and not self.tail_dropped

    @property
    def attends_encoded(self) -> bool:
        """Whether a decode step reads the encoded pairs where they lie through the C++ kernel (`attend_encoded`)
        instead of decoding the padded view: a lossy codec the kernel reads, on a CPU where it is built, and pairs to
        read (a kernel store holds at least one token)."""
        if self._kernel is None:  # the codec and the device are the store's for its life
            self._kernel = (not self.codec.lossless and kernel_layouts(self.codec, self.device)
                            and cpu_decode.available())
        return self._kernel and self._encoded.pairs > 0

    def attend(self, query: torch.Tensor, scaling: float, policy: Policy) -> torch.Tensor:
        """Decode attention of `query` [B, H_q, 1, D] (after `append`; `attends_by_head`, else `attends_encoded`:
        `attend_encoded`) over what each KV head holds: [B, 1, H_q, Dv], as transformers' attention functions return it.

        Each head attends over its pairs followed by the tail, with the head's query heads as its queries: it reads
        the pairs it keeps, as a cache of only those tokens would, instead of a view padded to the widest head (on
        KVzip's rankings ~1.8x the pairs) and a mask; heads of close lengths share one SDPA call, padded by a few
        masked slots (`JoinedHeads.attend`). The same softmax over the same keys as `full` + `mask` + SDPA (the
        reference), up to summation order. Each head's keys are a view of `joined` (joined here if they are apart:
        `_join`), so a step copies no pair (`policy`: the layer's, for the room the tail needs)."""
        if not self.attends_by_head:
            return self.attend_encoded(query, scaling)
        batch, q_heads, _, dim = query.shape
        heads = self.kv_heads
        assert self.tail_valid is not None  # the step's token joined the tail
        if self.joined is None:
            self._join(policy)
        assert self.joined is not None
        grouped = query.reshape(batch * heads, 1, q_heads // heads, dim)  # query heads k * groups + g: KV head k
        return self.joined.attend(grouped, scaling).reshape(batch, 1, q_heads, -1)

    def attend_encoded(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of `query` [B, H_q, 1, D] (after `append`; `attends_encoded`) through the C++ kernel:
        [B, 1, H_q, Dv], as `attend`.

        The kernel reads each head's encoded pairs where they lie in the flat store (`RaggedHeads.spans`): no
        padded view is assembled or decoded (dequantising and un-rotating every pair of the view, ~1.8x the pairs
        on KVzip's rankings, at every step), and no empty slot is read. The codec's exact sinks, the exact pairs'
        padded view (while they are within the residual) and the tail follow as the kernel's full-precision
        segment, joined by one `cat` when there is more than the tail, with a bias that hides their empty slots;
        every stored pair is valid, so the bias is needed only then. The same softmax over the same pairs as
        `full` + `mask` + SDPA (the reference), up to summation order."""
        batch, q_heads, q_len, dim = query.shape
        heads = self.kv_heads
        assert q_len == 1 and self.tail_valid is not None  # a decode step, after `append`
        tail_keys, tail_values = self.tail_keys, self.tail_values
        assert tail_keys is not None and tail_values is not None  # the step's token is in the tail
        keys, values, valid = [tail_keys], [tail_values], [self.tail_valid[:, None, :].expand(-1, heads, -1)]
        if self.exact is not None and self.exact.most:
            keys.insert(0, self.exact.padded(EXACT, "key", self.dtype))
            values.insert(0, self.exact.padded(EXACT, "value", self.dtype))
            valid.insert(0, self.exact.valid())
        if self.sink_valid is not None:
            assert self.sink_keys is not None and self.sink_values is not None  # held with `sink_valid`
            keys.insert(0, self.sink_keys.to(tail_keys.dtype))
            values.insert(0, self.sink_values.to(tail_values.dtype))
            valid.insert(0, self.sink_valid[:, None, :].expand(-1, heads, -1))
        pairs = self._encoded
        bias = None
        if len(keys) > 1 or self.tail_dropped:  # some full-precision slot may hold nothing
            plain_valid = torch.cat(valid, dim=-1) if len(valid) > 1 else valid[0]  # [B, H_kv, S + Me + Tt]
            bias = torch.zeros(batch, heads, 1, pairs.most + plain_valid.shape[-1], device=self.device)
            bias[:, :, 0, pairs.most:].masked_fill_(~plain_valid, float("-inf"))
        plain_keys = torch.cat(keys, dim=-2) if len(keys) > 1 else tail_keys
        plain_values = torch.cat(values, dim=-2) if len(values) > 1 else tail_values
        plain_q = (query.float() * scaling).reshape(batch, heads, q_heads // heads, dim)  # query heads k * groups + g
        out = attend_by_cpu_kernel(
            self.codec, plain_q, {n: t[None, None] for n, t in pairs.keys.items()},
            {n: t[None, None] for n, t in pairs.values.items()}, tail_values.shape[-1], bias, plain_keys,
            plain_values, spans=pairs.spans(),
        )
        return out.reshape(batch, 1, q_heads, -1).to(query.dtype)

    def mask(self, new: int, length: int) -> torch.Tensor:
        """[B, H_kv, new, length] bool: each head's slots of `full` that hold a pair, causal over the new tokens."""
        heads = self.kv_heads
        assert self.tail_valid is not None  # the step's tokens joined the tail (`append`)
        parts = [self.encoded.valid(), self.tail_valid[:, None, :].expand(-1, heads, -1)]
        if self.exact is not None:
            parts.insert(1, self.exact.valid())
        if self.sink_valid is not None:
            parts.insert(0, self.sink_valid[:, None, :].expand(-1, heads, -1))
        valid = torch.cat(parts, dim=-1)
        if new == 1:  # a decode step: its token is the newest slot, and every earlier slot is causal to it
            return valid[:, :, None, :]
        slot = torch.arange(length, device=self.device)
        causal = slot[None, :] <= (length - new + torch.arange(new, device=self.device))[:, None]  # [new, length]
        return valid[:, :, None, :] & causal[None, None]

    # -- after attention read the step: absorb and evict --------------------------------------------------------

    def compress(self, policy: Policy, seen: int) -> None:
        """Move recent tokens beyond the codec's residual into the pairs (`absorb`), then hold the allowance
        (`evict`). `seen`: the tokens the layer has been given, this step's included. Scored later tokens (KVzap)
        compete with the ranked pairs once they join them, so the tail keeps the policy's `recent` newest too:
        the tail's tokens go only when the pairs have none left to give."""
        self.absorb(seen, policy if self.tail_scores is not None else None)
        self.evict(policy)

    def absorb(self, seen: int, policy: Policy | None = None) -> None:
        """Move the tail's tokens beyond the codec's residual (and, with scored tokens, the `policy`'s `recent`
        newest) into the encoded pairs, a block at a time (the schedule depends on the tail's length only, the same
        for every row: a padded row is stored as it is alone). Scored tokens join with `policy.score` of the tail's
        scores (KVzap's span: each takes the best of the tokens after it, as the prompt's pairs did at the ranking);
        unscored ones rank above the ranked pairs, newest first."""
        t = self.tail_tokens
        if self.exact is not None and t >= self.codec.exact_residual:
            self._encode_exact()  # the later tokens fill the residual: the context's pairs are older than all of them
        n = (t - self._tail_kept(policy)) // ABSORB_BLOCK * ABSORB_BLOCK
        if n <= 0:
            return
        # n > 0 tokens in the tail: its three tensors are held.
        assert self.tail_keys is not None and self.tail_values is not None and self.tail_valid is not None
        if self.tail_scores is not None and policy is not None:
            pooled = policy.score(self.tail_scores, t)
            assert pooled is not None  # a policy with scored tokens ranks by them (KVzap)
            scores = pooled[:, :, :n]
        else:
            first = seen - t  # the oldest recent token's index among the tokens seen: newer ranks higher
            scores = LATER_TOKENS + first + torch.arange(n, device=self.device, dtype=torch.float32)
            scores = scores.expand(self.tail_valid.shape[0], self.kv_heads, n)
        keep = self.tail_valid[:, None, :n].expand(-1, self.kv_heads, -1)
        self.encoded.append(
            self.codec.encode(self.tail_keys[:, :, :n], "key"), self.codec.encode(self.tail_values[:, :, :n], "value"),
            scores, keep,
        )
        self.tail_keys = self.tail_keys[:, :, n:].clone() if n < t else None
        self.tail_values = self.tail_values[:, :, n:].clone() if n < t else None
        self.tail_valid = self.tail_valid[:, n:].clone() if n < t else None
        self.tail_dropped = self.tail_dropped and self.tail_valid is not None
        if self.tail_scores is not None:
            self.tail_scores = self.tail_scores[:, :, n:].clone() if n < t else None

    def _encode_exact(self) -> None:
        """Encode the context's full-precision pairs into the encoded pairs, after each head's, with their scores."""
        exact, self.exact = self.exact, None
        assert exact is not None  # `absorb` calls this only while exact pairs are held
        if not exact.most:  # every such pair was evicted
            return
        valid = exact.valid()  # [B, H, M]
        scores = torch.zeros(valid.shape, dtype=torch.float32, device=self.device)
        scores[valid] = exact.scores  # both in (row, head, pair) order
        keys, values = exact.padded(EXACT, "key", self.dtype), exact.padded(EXACT, "value", self.dtype)
        self.encoded.append(self.codec.encode(keys, "key"), self.codec.encode(values, "value"), scores, valid)

    def evict(self, policy: Policy) -> None:
        """Hold the allowance (`hold_allowance`): this store's alone, or, when it is the last of stores ranked
        together (`RankedTogether`), theirs in all; the others wait for it (every one has absorbed the step then)."""
        if self.together is None:
            hold_allowance([self], policy, self)
        elif self.together.stores[-1] is self:
            hold_allowance(self.together.stores, policy, self.together)

    # -- moves --------------------------------------------------------------------------------------------------------

    def crop(self, keep: int) -> None:
        raise ValueError(
            "cannot crop this cache: KVzip has already evicted tokens, so the cropped state cannot be rebuilt"
        )

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` [B'] (long), in that order (beam search, batch selection)."""
        self.encoded.select_rows(indices)
        if self.exact is not None:
            self.exact.select_rows(indices)
        for name in self.TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, indices))
        self.headroom = None
        if self.together is not None:
            self.together.headroom = None

    # -- saving, loading and bytes ----------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {f"store.{n}": t for n, t in self.encoded.state().items()}
        if self.exact is not None:
            tensors.update({f"exact.{n}": t for n, t in self.exact.state().items()})
        tensors.update({name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None})
        return tensors

    @classmethod
    def from_state(
        cls, codec: Codec, dtype: torch.dtype, tensors: dict[str, torch.Tensor], device: torch.device
    ) -> HeadStore:
        """The store `state()` described (other names in `tensors` are ignored), copied to `device`."""
        moved = {n: t.to(device, copy=True) for n, t in tensors.items()}
        encoded = RaggedHeads.from_state({n[len("store."):]: t for n, t in moved.items() if n.startswith("store.")})
        exact_tensors = {n[len("exact."):]: t for n, t in moved.items() if n.startswith("exact.")}
        exact = RaggedHeads.from_state(exact_tensors) if exact_tensors else None
        return cls(codec, dtype, encoded, exact, **{name: moved.get(name) for name in cls.TENSORS})

    def promised_bytes(self, rows: int, head_dim: int, value_dim: int, dtype: torch.dtype | None = None) -> int:
        """Bytes the store should hold for `rows` (batch x KV heads) rows: the encoded pairs at the codec's rate with
        their scores, the exact pairs, tail and sinks at full precision, and the per-row counts. With `dtype`: had
        the model run in that dtype (see `TokenStore.promised_bytes`)."""
        dtype = dtype or self.dtype
        element = torch.empty((), dtype=dtype).element_size()
        pair = self.codec.bytes_per_token(head_dim, "key", dtype) + self.codec.bytes_per_token(
            value_dim, "value", dtype
        )
        total = self._encoded.pairs * (pair + 4) + self._encoded.lengths.numel() * 8
        if self.exact is not None:
            total += self.exact.pairs * ((head_dim + value_dim) * element + 4) + self.exact.lengths.numel() * 8
        batch = self.real_seen.shape[0]
        # Joined, the tail's room is held whole (its rows are the store's), with the groups' gaps, masks and order
        # and the row of each head's next token (`JoinedHeads.layout_bytes`).
        tail_rows = self.tail_tokens if self.joined is None else self.joined.capacity
        total += rows * tail_rows * (head_dim + value_dim) * element
        if self.joined is not None:
            total += self.joined.layout_bytes((head_dim + value_dim) * element)
        total += batch * self.tail_tokens  # tail_valid
        if self.tail_scores is not None:
            total += rows * self.tail_tokens * 4  # float32
        total += 3 * batch * 8  # real_seen, allowance, share_then (int64)
        if self.sink_valid is not None:
            assert self.sink_keys is not None  # held with `sink_valid`
            total += self.sink_valid.numel() + 2 * self.sink_keys.numel() * element
        return int(total)
