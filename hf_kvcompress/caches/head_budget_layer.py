"""A full-attention layer after KVzip's global ranking: each KV head keeps its own number of context pairs.

`CompressedCache.end_reconstruction` ranks every (layer, KV head, token) pair of a row against each other under one
total (KVzip Sec. 3.3; kvpress's KVzipPress does the same with masks over memory it still holds) and replaces each
scored layer by this one, which stores only the kept pairs (`RaggedHeads`). The context's kept pairs still within
the codec's residual (the scored layer's full-precision tail) stay at full precision, in a second store, until
later tokens fill the residual. Later tokens (questions, answers) stay
at full precision for the codec's residual, then join the store, ranked above the context (newest first): when
the row holds more than its allowance, the lowest-scored pairs of any head go, the context's first, a block at a
time: down to the allowance less some slack (`EVICTION_SLACK`), so that eviction runs every few dozen steps instead
of nearly every step; the row never holds more than its allowance after an update. The codec's
full-precision sink tokens stay exact beside the store. Attention sees [sinks | padded view | padded exact view |
recent tokens] with a per-head mask, through 'kvcompress_sdpa' (`use_kvcompress_attention`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.identity import IdentityCodec
from .head_store import RaggedHeads, evict_lowest_across
from .finite_check import FiniteCheck
from .layer import CompressedLayer, batch_mismatch_hint
from .requests import ENABLE_ATTENTION_HINT, MASK_KEY, OwnMask, attention_kwargs

LATER_TOKENS = 2.0  # scores of tokens after the ranking start here: above any attention probability
ABSORB_BLOCK = 32  # recent tokens beyond the codec's residual join the store this many at a time
# Pairs per KV head a row over its allowance gives up beyond the excess (at most an eighth of the allowance, so a
# small budget is not emptied). Each decoded token adds a pair per head while a ratio's allowance grows by a fraction
# of one, so evicting only the excess sorted and copied the whole store on nearly every step; with this slack a
# row evicts once every ~EVICTION_SLACK / (1 - ratio) tokens, and still never holds more than its allowance.
EVICTION_SLACK = 32
SLACK_SHARE = 8
EXACT = IdentityCodec()  # how the context's pairs within the codec's residual are stored: as they are


class HeadBudgetLayer(FiniteCheck, CacheLayerMixin):
    """Context pairs kept per (row, KV head) in a ragged store, plus the recent tokens at full precision."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, origin: CompressedLayer, keep: torch.Tensor):
        """`origin`: the scored layer (its store is taken over); `keep` [B, H, T] bool: the pairs it keeps."""
        super().__init__()
        self.origin = origin
        self.policy, self.codec = origin.policy, origin.codec
        self.device, self.dtype = origin.device, origin.dtype
        self.batch_size, self.kv_heads = origin.batch_size, origin.kv_heads
        self.head_dim, self.value_dim = origin.head_dim, origin.value_dim
        self.seen = origin.seen
        self.real_seen = origin.padding.real_seen.clone()
        keep = keep.clone()
        # The codec's sinks (its first real tokens at full precision) stay exact, beside the store.
        self.sink_keys = self.sink_values = self.sink_valid = None
        if self.codec.sink_tokens > 0 and not self.codec.lossless:
            origin._capture_sinks()
            if origin.slots.sink_slots is not None:
                slots = origin.slots.sink_slots  # [B, H, S], the same for every head; -1: the row has no such token
                self.sink_keys, self.sink_values = origin.store.sink_keys, origin.store.sink_values
                self.sink_valid = slots[:, 0] >= 0  # [B, S]
                if not bool(keep.gather(2, slots.clamp(min=0))[slots >= 0].all()):
                    raise ValueError("the ranking evicted a codec sink token: its policy must protect them")
                keep.scatter_(2, slots.clamp(min=0), False)
        keys, values = origin.store.encoded_whole("key"), origin.store.encoded_whole("value")
        # Only what the scored layer has encoded enters the encoded store now; its tail (the context's newest tokens,
        # within the codec's residual) stays at full precision, as in every other layer, until `_absorb`.
        split = keep.shape[-1] if self.codec.lossless else origin.store.n_encoded
        encoded = keep.clone()
        encoded[..., split:] = False
        self.store = RaggedHeads.pack(keys, values, origin.slots.accumulated, encoded)
        self.exact: RaggedHeads | None = None  # the context's kept pairs within the residual, full precision
        if split < keep.shape[-1]:
            self.exact = RaggedHeads.pack(
                EXACT.encode(origin.store.tail_keys, "key"), EXACT.encode(origin.store.tail_values, "value"),
                origin.slots.accumulated[..., split:], keep[..., split:],
            )
        self.tail_keys = self.tail_values = None  # [B, H, t, D]: tokens since the ranking, full precision
        self.tail_valid: torch.Tensor | None = None  # [B, t] bool: False once a row evicted the token
        self.allowance = self.held_pairs()  # [B] pairs the row holds now: its share of the total
        self.share_then = self.policy.held_per_row(self.real_seen)
        self.own_mask: OwnMask | None = None
        self.finite, self.unchecked_steps = None, 0  # decode steps' deferred NaN/inf check (finite_check.py)
        self.headroom: int | None = None  # pairs every row may still add before one can be over (`_evict`)
        self.is_initialized = True
        origin.reset()  # its store now lives here; `CompressedCache.reset` puts the emptied layer back

    # -- transformers' layer contract -------------------------------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:  # built initialized, from a scored layer
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; return [sinks | padded store | recent] and hand attention the per-head mask."""
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.kv_heads:
            raise ValueError(
                f"this cache layer holds {self.batch_size} rows x {self.kv_heads} KV heads, got "
                f"{tuple(key_states.shape[:2])}: {batch_mismatch_hint(self.batch_size, key_states.shape[0])}"
            )
        if self.own_mask is not None and not self.own_mask.used:
            self.own_mask = None
            raise RuntimeError(f"KVzip with head budgets keeps a different number of pairs per head: {ENABLE_ATTENTION_HINT}")
        attn_kwargs = attention_kwargs(args, kwargs)
        if attn_kwargs is None:
            raise RuntimeError("this cache needs the attention kwargs that transformers passes to cache layers")
        self._check_finite(key_states, value_states)
        new = key_states.shape[-2]
        self.seen += new
        if self.headroom is not None:
            self.headroom -= new * self.kv_heads
        self.real_seen = self.real_seen + new  # padding only ever leads a row's prompt
        self.tail_keys = key_states.clone() if self.tail_keys is None else torch.cat([self.tail_keys, key_states], -2)
        self.tail_values = (
            value_states.clone() if self.tail_values is None else torch.cat([self.tail_values, value_states], -2)
        )
        fresh = torch.ones(self.batch_size, new, dtype=torch.bool, device=self.device)
        self.tail_valid = fresh if self.tail_valid is None else torch.cat([self.tail_valid, fresh], -1)
        full_keys, full_values = self._full("key"), self._full("value")
        self.own_mask = OwnMask(self._mask(new, full_keys.shape[-2]))
        attn_kwargs[MASK_KEY] = self.own_mask
        self._absorb()
        self._evict()
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self._view_length()
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    @property
    def stored_tokens(self) -> int:
        """Pairs held per KV head, on average over rows and heads (heads differ)."""
        return round(float(self.held_pairs().float().mean()) / self.kv_heads)

    def held_pairs(self) -> torch.Tensor:
        """Pairs each row holds, all heads together, [B]."""
        tail = 0 if self.tail_valid is None else self.tail_valid.sum(-1)
        exact = 0 if self.exact is None else self.exact.row_pairs()
        return self.store.row_pairs() + exact + self._sink_pairs() + tail * self.kv_heads

    def reset(self) -> None:
        """Nothing to clear: `CompressedCache.reset` puts the original layer back."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices, device=self.device)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.store.select_rows(indices)
        if self.exact is not None:
            self.exact.select_rows(indices)
        for name in self.STATE:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, indices))
        self.batch_size = indices.numel()
        self.headroom = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "cannot crop this cache: KVzip has already evicted tokens, so the cropped state cannot be rebuilt"
            )

    def promised_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes this layer should hold: stored pairs at the codec's rate with their scores, recent tokens and
        sinks at full precision, and the per-row bookkeeping. Tests compare it with `measured_kv_bytes`. With
        `dtype`: what it would hold had the model run in that dtype (see `CompressedLayer.promised_bytes`)."""
        dtype = dtype or self.dtype
        element = torch.empty((), dtype=dtype).element_size()
        pair = self.codec.bytes_per_token(self.head_dim, "key", dtype) + self.codec.bytes_per_token(
            self.value_dim, "value", dtype
        )
        total = self.store.pairs * (pair + 4) + self.store.lengths.numel() * 8
        if self.exact is not None:
            total += self.exact.pairs * ((self.head_dim + self.value_dim) * element + 4) + self.exact.lengths.numel() * 8
        recent = self.batch_size * self.kv_heads * self._tail_length() * (self.head_dim + self.value_dim) * element
        recent += self.batch_size * self._tail_length()  # tail_valid
        total += recent + 3 * self.batch_size * 8  # real_seen, allowance, share_then (int64)
        if self.sink_valid is not None:
            total += self.sink_valid.numel() + 2 * self.sink_keys.numel() * element
        if self.finite is not None:  # the decode steps' deferred check: one bool
            total += self.finite.numel() * self.finite.element_size()
        return int(total)

    # -- saving and loading (see caches/persist.py) ----------------------------------------------------------------

    KIND = "head_budgets"
    STATE = ("tail_keys", "tail_values", "tail_valid", "sink_keys", "sink_values", "sink_valid", "real_seen",
             "allowance", "share_then")

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        self._flush_finite_check()
        tensors = {f"store.{n}": t for n, t in self.store.state().items()}
        if self.exact is not None:
            tensors.update({f"exact.{n}": t for n, t in self.exact.state().items()})
        for name in self.STATE:
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        meta = {"kind": self.KIND, "seen": self.seen, "batch_size": self.batch_size, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "value_dim": self.value_dim, "dtype": str(self.dtype).removeprefix("torch.")}
        return tensors, meta

    @classmethod
    def from_state(cls, origin: CompressedLayer, tensors: dict[str, torch.Tensor], meta: dict, device) -> "HeadBudgetLayer":
        layer = cls.__new__(cls)
        CacheLayerMixin.__init__(layer)
        layer.origin = origin
        layer.policy, layer.codec = origin.policy, origin.codec
        layer.device, layer.dtype = torch.device(device), getattr(torch, meta["dtype"])
        for name in ("seen", "batch_size", "kv_heads", "head_dim", "value_dim"):
            setattr(layer, name, int(meta[name]))
        moved = {n: t.to(layer.device, copy=True) for n, t in tensors.items()}
        layer.store = RaggedHeads.from_state({n[len("store."):]: t for n, t in moved.items() if n.startswith("store.")})
        exact = {n[len("exact."):]: t for n, t in moved.items() if n.startswith("exact.")}
        layer.exact = RaggedHeads.from_state(exact) if exact else None
        for name in cls.STATE:
            setattr(layer, name, moved.get(name))
        layer.device = layer.real_seen.device
        layer.own_mask = None
        layer.finite, layer.unchecked_steps = None, 0
        layer.headroom = None
        layer.is_initialized = True
        return layer

    # -- internals -------------------------------------------------------------------------------------------------

    def _tail_length(self) -> int:
        return 0 if self.tail_keys is None else self.tail_keys.shape[-2]

    def _sink_pairs(self):
        """The codec's exact sink pairs per row, all heads together ([B], or 0 without sinks)."""
        return 0 if self.sink_valid is None else self.sink_valid.sum(-1) * self.kv_heads

    def _sink_count(self) -> int:
        return 0 if self.sink_valid is None else self.sink_valid.shape[-1]

    def _view_length(self) -> int:
        exact = 0 if self.exact is None else self.exact.most
        return self._sink_count() + self.store.most + exact + self._tail_length()

    def _full(self, kind: str) -> torch.Tensor:
        tail = self.tail_keys if kind == "key" else self.tail_values
        if self.codec.lossless and self.sink_valid is None:
            # A lossless codec gives the recent tokens back as they are: they join each head's pairs in the view's
            # one copy, instead of a second copy of the whole view by `cat`.
            return self.store.padded(self.codec, kind, self.dtype, after=self.codec.encode(tail, kind))
        parts = []
        if self.sink_valid is not None:
            parts.append((self.sink_keys if kind == "key" else self.sink_values).to(self.dtype))
        if self.store.most:
            parts.append(self.store.padded(self.codec, kind, self.dtype))
        if self.exact is not None and self.exact.most:
            parts.append(self.exact.padded(EXACT, kind, self.dtype))
        parts.append(tail)
        return torch.cat(parts, dim=-2)

    def _mask(self, new: int, length: int) -> torch.Tensor:
        """[B, H_kv, new, length] bool: each head's slots that hold a pair, causal over the new tokens."""
        valid = [self.store.valid(), self.tail_valid[:, None, :].expand(-1, self.kv_heads, -1)]
        if self.exact is not None:
            valid.insert(1, self.exact.valid())
        if self.sink_valid is not None:
            valid.insert(0, self.sink_valid[:, None, :].expand(-1, self.kv_heads, -1))
        valid = torch.cat(valid, dim=-1)
        if new == 1:  # a decode step: its token is the newest slot, and every earlier slot is causal to it
            return valid[:, :, None, :]
        slot = torch.arange(length, device=self.device)
        causal = slot[None, :] <= (length - new + torch.arange(new, device=self.device))[:, None]  # [new, length]
        return valid[:, :, None, :] & causal[None, None]

    def _absorb(self) -> None:
        """Move the recent tokens beyond the codec's residual into the store, a block at a time (the schedule
        depends on the tail's length only, the same for every row: a padded row is stored as it is alone)."""
        t = self._tail_length()
        if self.exact is not None and t >= self.codec.residual_length:
            self._encode_exact()  # the later tokens fill the residual: the context's pairs are older than all of them
        n = (t - self.codec.residual_length) // ABSORB_BLOCK * ABSORB_BLOCK
        if n <= 0:
            return
        first = self.seen - t  # the oldest recent token's index among the tokens seen: newer ranks higher
        scores = LATER_TOKENS + first + torch.arange(n, device=self.device, dtype=torch.float32)
        scores = scores.expand(self.batch_size, self.kv_heads, n)
        keep = self.tail_valid[:, None, :n].expand(-1, self.kv_heads, -1)
        self.store.append(
            self.codec.encode(self.tail_keys[:, :, :n], "key"), self.codec.encode(self.tail_values[:, :, :n], "value"),
            scores, keep,
        )
        self.tail_keys = self.tail_keys[:, :, n:].clone() if n < t else None
        self.tail_values = self.tail_values[:, :, n:].clone() if n < t else None
        self.tail_valid = self.tail_valid[:, n:].clone() if n < t else None

    def _encode_exact(self) -> None:
        """Encode the context's full-precision pairs into the store, after each head's pairs, with their scores."""
        exact, self.exact = self.exact, None
        if not exact.most:  # every such pair was evicted
            return
        valid = exact.valid()  # [B, H, M]
        scores = torch.zeros(valid.shape, dtype=torch.float32, device=self.device)
        scores[valid] = exact.scores  # both in (row, head, pair) order
        keys, values = exact.padded(EXACT, "key", self.dtype), exact.padded(EXACT, "value", self.dtype)
        self.store.append(self.codec.encode(keys, "key"), self.codec.encode(values, "value"), scores, valid)

    def _evict(self) -> None:
        """Hold at most the row's allowance (its share at the ranking, moved since as the policy's share of the tokens
        seen moves: a ratio's, or a budget's until the row has seen that many): the lowest-scored stored pairs of any
        head go first (the context before later tokens), down to the allowance less the slack; a row whose store has
        nothing left to give drops just enough of its oldest recent tokens.

        Each token adds one pair per head and an allowance never shrinks, so after a check no row can be over until
        the rows have added the smallest room left (`headroom`): the steps between skip the check and its host read.
        """
        if self.headroom is not None and self.headroom >= 0:
            return
        allowance = self.allowance + self.kv_heads * (self.policy.held_per_row(self.real_seen) - self.share_then)
        over = (self.held_pairs() - allowance).clamp(min=0)
        if not bool((over > 0).any()):
            self.headroom = int((allowance - self.held_pairs()).min())
            return
        slack = torch.where(over > 0, (allowance // SLACK_SHARE).clamp(max=EVICTION_SLACK * self.kv_heads), 0)
        stores = [self.store] if self.exact is None else [self.store, self.exact]
        from_store = torch.minimum(over + slack, sum(store.evictable() for store in stores))
        evict_lowest_across(stores, from_store.tolist())
        rest = (over - from_store).clamp(min=0)  # the slack comes from the store only, never from recent tokens
        if self.tail_valid is not None and bool((rest > 0).any()):
            tokens = (rest + self.kv_heads - 1) // self.kv_heads  # whole tokens: every head of the row
            oldest = self.tail_valid & (self.tail_valid.long().cumsum(-1) <= tokens[:, None])
            self.tail_valid = self.tail_valid & ~oldest
        self.headroom = int((allowance - self.held_pairs()).min())

