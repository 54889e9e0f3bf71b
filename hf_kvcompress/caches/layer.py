"""One decoder layer's compressed cache: a policy (which tokens stay) x a codec (how they are stored).

This module holds transformers' layer contract and the order of a step (`update`); the layer's state lives in
parts it owns, each with its own tensors and methods:
- `store` (storage.py): [encoded | tail], the codec's exact sinks and a padded batch's exact rows; after KVzip's head
  ranking a `HeadStore` (head_store.py, see `rank_heads`);
- `slots` (slot_records.py): every per-slot tensor, moved together when slots move;
- `padding` (padding.py): each row's left padding and the masks that follow from it;
- `scorer` (scorers.py), chosen once from the policy's flags: what it scores with (Expected Attention's newest
  queries, KVzip's reconstruction pass), how the scores arrive and whether eviction waits for attention;
- `eviction` (eviction.py): how many tokens each row keeps (and a pass's per-layer shift) and which slots stay;
- `offers` (store_offer.py): the fused decode path's offer of the encoded store to attention;
- `finite` (finite_check.py): the deferred NaN/inf check.
Functions without state: codec_sinks.py (which slots are the codec's exact sinks), rerotation.py (StreamingLLM's
re-rotation). docs/architecture.md draws the whole layer. What attention functions read from the attention kwargs is
in requests.py.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.base import Codec, Kind
from ..policies.base import Policy
from ..policies.block_window import BlockWindowPolicy
from .codec_sinks import first_real_slots
from .eviction import Eviction
from .finite_check import FINITE_CHECK_EVERY, NON_FINITE, FiniteCheck
from .head_store import HeadStore
from .padding import CHUNKS_SPLIT_PADDED_ROWS, END_ALIGNED_CHUNKS, PADDING_SPLITS_GROUPS, RowPadding
from .requests import (
    ENABLE_ATTENTION_HINT,
    MASK_KEY,
    OBSERVER_KEY,
    STORE_KEY,
    AttentionRequest,
    OwnMask,
    StoreRequest,
    attention_kwargs,
)
from .rerotation import rerotate_kept, step_positions
from .scorers import Scorer, scorer_for
from .slot_records import SlotRecords, record
from .storage import TokenStore, stored
from .store_attention import attend_store
from .store_offer import StoreOffers

# Importers of this module's names from before the split (generation.py, hf/attention.py, tests) keep working.
__all__ = [
    "CHUNKS_SPLIT_PADDED_ROWS", "ENABLE_ATTENTION_HINT", "END_ALIGNED_CHUNKS", "FINITE_CHECK_EVERY", "MASK_KEY",
    "NON_FINITE", "OBSERVER_KEY", "PADDING_SPLITS_GROUPS", "STORE_KEY", "AttentionRequest", "CompressedLayer",
    "OwnMask", "StoreRequest",
]


def batch_mismatch_hint(held: int, got: int) -> str:
    """What to do when a step brings another number of rows than the cache holds. generate() expands the rows
    for beams and num_return_sequences but not a cache that was prefilled (transformers' DynamicCache fails there
    too), so that case is named."""
    hint = "call cache.reset() first"
    if held and got > held and got % held == 0:
        hint += (f", or, to decode {got // held} beams or sequences per row from a prefilled cache (num_beams, "
                 f"num_return_sequences), call cache.batch_repeat_interleave({got // held}) before generate()")
    return hint


def scorer_state(name: str, writable: bool = False) -> property:
    """A layer attribute that reads (and, `writable`, writes) its scorer's `name`, for code that reads it by its name
    from before the scorer owned it (tests, probes; CompressedCache sets `reconstruction_queries`). None when the
    layer's scorer has no such state."""

    def get(layer):
        return getattr(layer.scorer, name, None)

    def set_(layer, value):
        setattr(layer.scorer, name, value)

    return property(get, set_ if writable else None, doc=f"`scorer.{name}` (see caches/scorers.py).")


class CompressedLayer(CacheLayerMixin):
    """Stores a layer's kept tokens as [encoded store | full-precision tail].

    New tokens join the tail; the policy evicts down to its budget (right away, or after attention when it
    scores by attention); tail tokens beyond the codec's residual are encoded a block at a time and never
    re-encoded. Slots stay in token order with each row's padding first, so `get_mask_sizes` lets transformers'
    own masks line up with what is kept, and the standard attention functions work unchanged.
    """

    is_compileable = False
    # The per-slot records under their names from before `slots` (tests, benchmarks/probes read them).
    accumulated = record("accumulated")
    positions = record("positions")
    sink_slots = record("sink_slots")
    # Each row's padding counts under their names from before `padding` (tests and probes read them).
    pads = property(lambda self: None if self.padding is None else self.padding.pads)
    real_seen = property(lambda self: None if self.padding is None else self.padding.real_seen)
    # The store's tensors under their names from before `store` (tests, store_attention's callers read them).
    encoded_keys, encoded_values, n_encoded = stored("encoded_keys"), stored("encoded_values"), stored("n_encoded", 0)
    tail_keys, tail_values = stored("tail_keys"), stored("tail_values")
    sink_keys, sink_values = stored("sink_keys"), stored("sink_values")
    exact_rows, exact_keys, exact_values = stored("exact_rows"), stored("exact_keys"), stored("exact_values")
    # The scorer's state under its names from before `scorer` (see `scorer_state`).
    awaiting_attention, scored = scorer_state("awaiting_attention"), scorer_state("scored")
    recent_queries, next_position = scorer_state("recent_queries"), scorer_state("next_position")
    reconstruction_queries = scorer_state("reconstruction_queries", writable=True)

    def __init__(
        self, policy: Policy, codec: Codec, is_sliding: bool = False, inv_freq: torch.Tensor | None = None,
        query_inv_freq: torch.Tensor | None = None, attention_window: int | None = None, probe=None,
    ):
        """`inv_freq` (RoPE frequencies) turns on StreamingLLM's re-rotation: after each eviction, kept keys are
        re-rotated so that their distances to the next query are their distances in the cache. `query_inv_freq`:
        the RoPE frequencies a policy that keeps queries (`needs_queries`) undoes their rotation with (empty: the
        model does not rotate them). `attention_window`: a sliding_attention layer's window (the model's
        `sliding_window`): a query sees only keys less than that many positions back, which the layer's own mask
        must say too, since a block window holds older tokens (`_drop_old_blocks`). `probe`: the layer's score
        probe (probes.py), for a policy that scores tokens from their hidden states (KVzap)."""
        super().__init__()
        self.attention_window = attention_window
        self.policy = policy
        self.codec = codec
        self.is_sliding = is_sliding
        self.inv_freq = inv_freq
        # Numbers, not a tensor: a configuration, not cache storage (measured_kv_bytes counts every tensor it finds).
        self.query_inv_freq = None if query_inv_freq is None else tuple(query_inv_freq.tolist())
        self.probe = probe  # model weights (a torch Module, shared by every cache of the model), not cache storage
        if inv_freq is not None and not (codec.lossless and policy.evicts):
            raise ValueError("rerotate needs an evicting policy and full-precision keys (codec 'identity')")
        self.offers = StoreOffers(self.codec, rerotates=self.inv_freq is not None)  # `_clear` clears its offer
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None  # unused: kept for code that inspects transformers layers
        self.is_initialized = False
        self.seen = 0  # tokens this layer has been given, evicted ones included
        # The stored states: [encoded | tail], exact sinks and rows (storage.py), from the first step on.
        self.store: TokenStore | HeadStore | None = None
        self.padding: RowPadding | None = None  # each row's left padding (padding.py), from the first step on
        # Every tensor that follows the slots when they move (attention scores, key positions, sink slots).
        self.slots = SlotRecords()
        # How the policy's scores arrive and what it scores with besides the stored state (the newest queries,
        # KVzip's pass): the same kind for the layer's life (the policy's flags), fresh state at each reset.
        self.scorer: Scorer = scorer_for(self.policy, self.query_inv_freq, self.probe)
        self.peak_tokens = 0  # most tokens held at once, the step's new ones included
        self.eviction = Eviction(self.policy, self.codec.heads_per_store)  # keep counts, a pass's per-layer shift
        self.own_mask: OwnMask | None = None  # the mask handed to attention at the last step, if any
        self.finite = FiniteCheck()
        self.offers.clear()

    # -- transformers' layer contract -------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.codec = self.codec.for_device(self.device)  # what it stores may depend on the device (lowrank's compute)
        self.batch_size, self.kv_heads, _, self.head_dim = key_states.shape
        self.value_dim = value_states.shape[-1]
        self.codec.check_head_dim(self.head_dim)
        self.codec.check_head_dim(self.value_dim)
        self.padding = RowPadding(self.batch_size, self.device)
        self.store = TokenStore(self.codec, self.dtype)
        self.is_initialized = True

    def _check_shape(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if (heads, dim, value_states.shape[-1]) != (self.kv_heads, self.head_dim, self.value_dim):
            raise ValueError(
                f"this cache layer holds {self.kv_heads} KV heads x {self.head_dim} dims, got {heads} x {dim}: "
                "a cache object serves one model; call cache.reset() or create a new cache"
            )
        if key_states.device != self.device:
            raise ValueError(
                f"this cache holds its tensors on {self.device}, got states on {key_states.device}: save it with "
                "save_cache and load it with load_cache(path, device=...) to move it"
            )
        if batch != self.batch_size:
            raise ValueError(
                f"this cache holds a batch of {self.batch_size} rows, got {batch}: "
                f"{batch_mismatch_hint(self.batch_size, batch)}"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new states; return everything attention may see this step (kept before + new)."""
        if self.is_initialized:
            self._check_shape(key_states, value_states)  # device, heads and batch first: the check below reads values
        self.finite.check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.scorer.awaiting_attention:
            raise RuntimeError(f"{type(self.policy).__name__} scores tokens by attention: {ENABLE_ATTENTION_HINT}")
        self.check_mask_used()
        self.offers.check_used()
        attn_kwargs = attention_kwargs(args, kwargs)
        if self.scorer.reconstruction_queries is not None:
            return self._reconstruction_step(key_states, value_states, attn_kwargs)
        new = key_states.shape[-2]
        if self.per_head:  # KVzip's head budgets (`rank_heads`): the store evicts by its own scores
            return self._per_head_step(key_states, value_states, attn_kwargs)
        self.scorer.check_step(self, new)
        # From here on a token layer after `lazy_initialization`: a head store took the per-head path above.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        self.padding.count(attn_kwargs, new, self.seen)
        self.padding.check_chunk_alignment(new, self.seen)
        self.seen += new

        self._append_tail(key_states, value_states)
        if self.codec.encodes_on_arrival:  # attention reads the step's tokens as stored (codecs/base.py)
            self._encode_tail()
        length = self.stored_tokens
        self.peak_tokens = max(self.peak_tokens, length)
        if self.inv_freq is not None or self.policy.needs_positions or self.codec.needs_positions:
            # Every KV head holds the same slots until an eviction keeps slots per head (`SlotRecords.take` widens
            # the record then): one position per slot, unless a re-rotation or the policy reads them per head.
            per_head = self.inv_freq is not None or self.policy.needs_positions
            heads = self.kv_heads if per_head else 1
            fresh = step_positions(attn_kwargs, self.seen - new, new, self.batch_size, heads, self.device)
            self.slots.append("positions", fresh)

        # A ratio changes what rows keep only when the step evicts (a step that appends moves every row alike).
        shares_may_change = self.policy.ratio is not None and not self.eviction.appends(new)
        if self.eviction.budget_shift is not None or self.padding.misplaces_shared_mask(
            self.seen, length, shares_may_change=shares_may_change
        ):
            self._own_mask(attn_kwargs, new, length)
        if self.scorer.begin_step(self, attn_kwargs, new):  # eviction waits for attention (scorers.py)
            return self._full("key"), self._full("value")
        if self.offers.may_attend(self.store, attn_kwargs, new):
            assert attn_kwargs is not None  # `may_attend` says no without them
            placeholders = self.offers.offer(
                self, attn_kwargs, (self.batch_size, self.kv_heads, length, self.head_dim),
                (self.batch_size, self.kv_heads, length, self.value_dim), self.dtype, self.device,
            )
            if placeholders is not None:  # our attention function attends and compresses (`attend`)
                return placeholders
        self.offers.probe(self, attn_kwargs, new)
        full_keys, full_values = self._full("key"), self._full("value")
        self._compress()
        return full_keys, full_values

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Called by our attention function for a fused step (store_offer.py): attention over what this layer
        holds, then the step's eviction and encoding. A head store (`_per_head_step`) attends over each head's own
        pairs: it holds no padding pair, so transformers' mask has nothing to add."""
        if isinstance(self.store, HeadStore):
            output = self.store.attend(query, scaling, self.policy)
            self.store.compress(self.policy, self.seen)
            return output
        output = attend_store(self, query, attention_mask, scaling)
        self._compress()
        return output

    def observe(self, delivered: torch.Tensor) -> None:
        """Called by attention (the scorer's `AttentionRequest.deliver`) with what the scorer asked for: statistics
        [B, H_kv, kv] or the newest queries [B, H_q, n, D]. The scorer keeps them; then the layer evicts and encodes,
        unless a reconstruction pass runs (its end evicts)."""
        if self.scorer.observe(self, delivered):
            self._compress()
            self.scorer.after_compress(self)

    # -- KVzip's reconstruction pass, driven by generation.prefill through CompressedCache (scorers.py) ---------

    def begin_reconstruction(self) -> None:
        if self.is_initialized:
            self.scorer.begin_reconstruction(self)

    def _reconstruction_step(self, key_states, value_states, attn_kwargs):
        """Attend over kept + reconstruction tokens and keep nothing new; the scorer may ask attention to score."""
        self._check_shape(key_states, value_states)
        full_keys = torch.cat([self._full("key"), key_states], dim=-2)
        full_values = torch.cat([self._full("value"), value_states], dim=-2)
        self.peak_tokens = max(self.peak_tokens, full_keys.shape[-2])
        self.scorer.reconstruction_step(self, attn_kwargs)
        return full_keys, full_values

    def check_attention_served(self) -> None:
        """After a reconstruction step: refuse when the statistics it asked for never arrived (scorers.py)."""
        self.scorer.check_attention_served(self)

    def end_reconstruction(self, evict: bool = True) -> None:
        """Evict the lowest-scored slots down to the budget (`evict=False`: the pass failed; keep every slot
        unscored)."""
        if self.scorer.end_reconstruction(self, evict):
            self._compress()

    # -- the store -------------------------------------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        return 0 if self.store is None else self.store.stored_tokens

    @property
    def per_head(self) -> bool:
        """Each KV head keeps its own number of pairs: the store is a `HeadStore` (`rank_heads`)."""
        return self.store is not None and self.store.per_head

    def rank_heads(self, scores: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the pairs `keep` [B, H_kv, T] (bool) of this layer's slots, scored `scores` [B, H_kv, T]: KVzip's
        head budgets (one ranking of every layer's pairs, head_ranking.py) give each KV head its own number. The
        store becomes a `HeadStore` (head_store.py), which keeps the codec's sinks exact beside the pairs, counts
        each row's real tokens (no padding pair is kept: the layer's padding goes) and evicts by those scores."""
        self.scorer.reconstruction_queries = None
        self.scorer.awaiting_attention = False
        sink_slots = None
        if self.codec.exact_sinks > 0 and not self.codec.lossless:
            self._capture_sinks()  # before the pairs are packed: the sinks are the row's first real tokens
            sink_slots = self.slots.sink_slots
        # Ranked once, after the reconstruction pass over a token layer (CompressedCache.end_reconstruction).
        assert isinstance(self.store, TokenStore) and self.padding is not None
        self.store.unreduce(self.slots.positions)  # a stack's held residual joins the tail: ranked pairs are whole
        # KVzap scores later tokens by its probe (`later_scores`): the prompt's recent window starts the tail with
        # its estimates, so that it competes as decoded tokens do once it is no longer recent (head_store.py `rank`).
        window_scores = self.slots.accumulated if self.policy.needs_hidden_states else None
        self.store = HeadStore.rank(self.store, scores, keep, sink_slots, self.padding.real_seen, self.policy,
                                    window_scores)
        self.slots = type(self.slots)()  # the store holds each pair's score
        self.padding = None
        self.scorer.scored = True

    def _per_head_step(self, key_states: torch.Tensor, value_states: torch.Tensor, attn_kwargs: dict | None):
        """A step over a `HeadStore`: the new tokens join its tail, attention reads each head's pairs (through this
        layer's per-head mask, or, for a decode step that our attention takes as offered, over each head's own pairs:
        `attend`), then the store absorbs and evicts (head_store.py)."""
        if attn_kwargs is None:
            raise RuntimeError("this cache needs the attention kwargs that transformers passes to cache layers")
        new = key_states.shape[-2]
        self.seen += new
        assert isinstance(self.store, HeadStore)  # `update` comes here when `per_head`
        self.store.append(key_states, value_states, self.scorer.later_scores(self, attn_kwargs, new))
        if new == 1 and (self.store.attends_by_head or self.store.attends_encoded):
            # Offered as the fused path is (store_offer.py): once our attention function has taken an offer, it
            # attends over each head's own pairs (`attend`: as they lie, or encoded through the C++ kernel) and
            # `update` returns placeholders; until then (the first decode step) the padded view and mask below serve,
            # and confirm that it runs.
            length = self.store.view_tokens
            placeholders = self.offers.offer(
                self, attn_kwargs, (self.batch_size, self.kv_heads, length, self.head_dim),
                (self.batch_size, self.kv_heads, length, self.value_dim), self.dtype, self.device, quiet=True,
            )
            if placeholders is not None:
                return placeholders
        full_keys, full_values = self._full("key"), self._full("value")
        self.own_mask = OwnMask(self.store.mask(new, full_keys.shape[-2]))
        attn_kwargs[MASK_KEY] = self.own_mask
        self.store.compress(self.policy, self.seen)
        return full_keys, full_values

    def _append_tail(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        assert isinstance(self.store, TokenStore)  # a token layer's step
        self.store.append(key_states, value_states)

    def _full(self, kind: Kind) -> torch.Tensor:
        """What attention sees: the decoded store followed by the full-precision tail."""
        assert self.store is not None  # read from the first step on
        if self.codec.needs_positions:  # keys decode at their positions (a head store never holds such a codec)
            assert isinstance(self.store, TokenStore)
            return self.store.full(kind, self.slots.sink_slots, self.slots.positions)
        return self.store.full(kind, self.slots.sink_slots)

    def _encode_tail(self) -> None:
        """Encode tail tokens beyond the codec's full-precision residual, whole blocks at a time."""
        assert isinstance(self.store, TokenStore)  # a token layer's step (a head store encodes in `compress`)
        self.store.encode_tail(self._before_encoding, self.slots.positions)

    def _before_encoding(self, first: bool) -> None:
        # Padding grows only with prompt chunks: decode steps after the first encoding need not ask (a host read).
        block_k = self.codec.token_block("key")
        assert self.padding is not None  # called by a token store's `encode_tail`
        if block_k > 1 and (first or self.padding.prompt_step) and bool((self.padding.pads % block_k != 0).any()):
            warnings.warn(PADDING_SPLITS_GROUPS.format(group=block_k), stacklevel=4)
        if first:
            self._capture_sinks()

    # -- eviction ---------------------------------------------------------------------------------------------------

    def over_budget(self) -> bool:
        """Whether this layer holds more than its policy keeps, even before a reconstruction pass scored it."""
        return self.padding is not None and self.eviction.over_budget(self.padding, self.stored_tokens)

    def _compress(self) -> None:
        """After a step's attention: evict down to the budget (when due), then encode the tail beyond the codec's
        residual."""
        if self.policy.drops_blocks:  # a sliding window over per-channel key groups
            self._drop_old_blocks()
        else:
            assert self.padding is not None  # a token layer after a step (a head store evicts by itself)
            due = self.eviction.due(self.padding, self.scorer.has_scores, self.stored_tokens)
            if due is not None:
                self._evict(*due)
        self._encode_tail()

    def _evict(self, keep: torch.Tensor, most: int, even: bool) -> None:
        """Keep each row's `keep` best-scored real tokens (`most` of them at the most; `even`: every row keeps `most`
        behind no padding), and move every part along."""
        # A token layer after its first step: a head store (`rank_heads`) evicts by itself (head_store.py).
        assert isinstance(self.store, TokenStore) and self.padding is not None
        self.eviction.refuse_unknown_padding(self.padding)
        self.padding.evicting()
        length = self.stored_tokens
        keys = self._full("key") if self.policy.needs_keys else None
        extra = self.scorer.score_inputs(self)  # what the scorer keeps for the policy (queries=), handed only to it
        if self.policy.needs_values:
            extra["values"] = self._full("value")
        scores = self.policy.score(
            self.slots.accumulated, length, keys=keys, positions=self.slots.positions, pads=self.padding.pads, **extra
        )
        if not self.store.holds_encoded:
            self._capture_sinks()
        if self.slots.empty and self.inv_freq is None and self.store.can_slide(length - 1) and self.eviction.slides(
            scores, length, most, even
        ):
            # A window sliding by one token (sink_window's decode step): the store drops the slot in place instead of
            # gathering every kept one; rows without padding drop the slot after their sinks, the others a padding
            # slot. `moves` is read before `kept` moves the padding.
            moves = self.padding.pads == 0
            self.padding.kept(most, keep, length, self.eviction.fixed_budget)
            self.store.slide(moves, self.policy.sink_tokens)
            return
        kept = self.eviction.choose(self.padding, scores, self.kv_heads, length, keep, most, even)  # [B, H_kv, budget]
        positions = self.slots.positions  # before the move: the store encodes kept tail keys at them
        self.slots.take(kept)  # scores, positions and sink slots follow the kept slots
        self.padding.kept(kept.shape[-1], keep, length, self.eviction.fixed_budget)
        rerotate = self.store.encoded_keys is None and self.inv_freq is not None
        self.store.take(kept, positions)
        if rerotate:
            assert self.inv_freq is not None
            rerotate_kept(self.store, self.slots, self.padding.real_seen, self.inv_freq)

    def _drop_old_blocks(self) -> None:
        """A block window (policies/block_window.py): drop the oldest whole blocks of `policy.block` tokens that lie
        entirely before the newest `policy.window` tokens, from the encoded store (whole encoded blocks, cut
        without decoding) and then from the tail, and move every per-slot record along.

        Per-channel key groups (KIVI) quantize a block of tokens together, so such a layer cannot drop one token per
        step as the exact window does: it holds between `window` and `window + block - 1` tokens. Dropping a whole
        number of blocks from slot 0 keeps slot 0 on a block boundary of the row's tokens, so a row left-padded by
        whole blocks is grouped as when run alone. Slots stay the newest tokens in order, so `get_mask_sizes`
        still gives each slot its absolute position and transformers' sliding mask hides the older ones; attention
        paths that build their own mask honour the window too (padding.py `RowPadding.mask`)."""
        assert isinstance(self.policy, BlockWindowPolicy)  # the only policy whose `drops_blocks` is True
        # A token layer after its first step: a block window is never ranked into a head store.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        drop = self.stored_tokens - self.policy.held(self.stored_tokens)
        if drop == 0:
            return
        if not self.store.holds_encoded:
            self._capture_sinks()  # while the tail still holds every token seen
        self.padding.evicting()
        self.store.drop(drop)
        self.padding.drop(drop)  # padding is the oldest slots
        # Every per-slot record loses the same slots; a sink whose block is dropped is gone, as when the exact
        # window passes it.
        self.slots.drop(drop)

    def _capture_sinks(self) -> None:
        """Copy each row's first `codec.exact_sinks` real tokens (codec_sinks.py) before anything is encoded or
        evicted, while the tail still holds every token in order."""
        sinks = self.codec.exact_sinks
        if sinks == 0 or self.slots.sink_slots is not None or self.stored_tokens != self.seen:
            return
        # A token layer after its first step: sinks are captured before anything is encoded, evicted or ranked.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        self.slots.sink_slots = first_real_slots(sinks, self.padding, self.kv_heads)
        self.store.capture_sinks(self.slots.sink_slots)

    # -- save and load (persist.py), under the names files were always saved with ---------------------------------

    STATE_SCALARS = ("seen", "peak_tokens", "batch_size", "kv_heads", "head_dim", "value_dim")
    HEAD_STORE_SCALARS = ("seen", "batch_size", "kv_heads", "head_dim", "value_dim")  # with meta `kind`

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This layer's tensors by name, and the numbers that describe them, for `save_cache`: each part's own."""
        if self.scorer.awaiting_attention:
            raise RuntimeError("cannot save a cache layer in the middle of a step (it awaits attention statistics)")
        self.finite.flush()
        meta: dict = {"dtype": str(self.dtype).removeprefix("torch.")}
        if self.per_head:  # KVzip's head budgets: meta `kind` selects the store kind on load
            assert isinstance(self.store, HeadStore)
            meta.update(kind=self.store.KIND, **{name: getattr(self, name) for name in self.HEAD_STORE_SCALARS})
            return self.store.state(), meta
        # An initialized token layer: persist.py exports only layers that have seen a step.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        tensors = {**self.eviction.state(), **self.store.state(), **self.slots.state(), **self.padding.state()}
        scorer_tensors, scorer_meta = self.scorer.state()
        tensors.update(scorer_tensors)
        meta.update({name: getattr(self, name) for name in self.STATE_SCALARS}, **scorer_meta)
        meta.update(n_encoded=self.store.n_encoded, padding_unknown=self.padding.unknown)
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
        """Restore what `export_state` returned, on `device`."""
        self._clear()
        self.dtype = getattr(torch, meta["dtype"])
        self.codec = self.codec.for_device(torch.device(device))  # before the store: what it holds may depend on it
        if meta.get("kind") == HeadStore.KIND:
            for name in self.HEAD_STORE_SCALARS:
                setattr(self, name, int(meta[name]))
            self.store = HeadStore.from_state(self.codec, self.dtype, tensors, torch.device(device))
            self.padding = None  # the store counts each row's real tokens
            self.device = self.store.device  # "cuda" resolves to "cuda:0", as the model's states will say
            self.scorer.scored = True
            self.is_initialized = True
            return
        for name in self.STATE_SCALARS:
            setattr(self, name, int(meta[name]))
        self.padding = RowPadding.from_state(tensors, bool(meta["padding_unknown"]), torch.device(device))
        self.device = self.padding.pads.device  # "cuda" resolves to "cuda:0", as the model's states will say
        self.eviction.load_state(tensors, self.device)
        self.scorer.load_state(tensors, meta, self.device)  # `_clear` gave it a fresh state
        self.slots = type(self.slots).from_state(tensors, self.device)  # `_clear` chose the records
        # The slots' positions first: a codec that `needs_positions` (lowrank's joint bases) decodes keys at them.
        self.store = TokenStore.from_state(self.codec, self.dtype, tensors, int(meta["n_encoded"]), self.device,
                                           self.slots.positions)
        self.is_initialized = True

    # -- the layer's own mask ---------------------------------------------------------------------------------------

    def _own_mask(self, attn_kwargs: dict | None, new: int, length: int) -> None:
        """Give attention this layer's [B, 1, new, length] mask (its padding first, causal over the new tokens, within
        a sliding layer's `attention_window`): transformers' one mask cannot fit when layers keep different numbers
        of tokens or rows different shares."""
        if attn_kwargs is None:
            raise RuntimeError("this cache needs the attention kwargs that transformers passes to cache layers")
        assert self.padding is not None  # a token layer's step
        self.own_mask = OwnMask(self.padding.mask(new, length, self.attention_window))
        attn_kwargs[MASK_KEY] = self.own_mask

    def check_mask_used(self) -> None:
        """Refuse to go on when the last step's own mask was ignored (the model does not use our attention)."""
        if self.own_mask is not None and not self.own_mask.used:
            self.own_mask = None
            if self.per_head:
                raise RuntimeError(
                    f"KVzip with head budgets keeps a different number of pairs per head: {ENABLE_ATTENTION_HINT}"
                )
            raise RuntimeError(
                f"{type(self.policy).__name__} with a ratio in a padded batch (or per-layer budgets) keeps what "
                f"transformers' shared attention mask cannot describe: {ENABLE_ATTENTION_HINT}"
            )
        self.own_mask = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.store is None else self.store.view_tokens  # a head store's: the widest head's
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        # A ratio does not bound the length, nor does a row's budget bound a head's (head budgets), nor a budget
        # that decode steps grow past (SnapKV's `decoding="append"`).
        if self.policy.budget is None or self.per_head or not self.policy.evicts_while_decoding:
            return -1
        return self.policy.budget

    def promised_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes this layer should hold, from what it keeps: encoded tokens at the codec's rate, the tail at full
        precision, plus its bookkeeping (padding counts, attention scores, positions). Tests compare this with
        `measured_kv_bytes`, which reads the real storage. With `dtype`: what it would hold had the model run in
        that dtype (keys and values at its width; codes, scales, scores and positions keep theirs)."""
        if not self.is_initialized:
            return 0
        assert self.store is not None  # set with `is_initialized`
        stored = self.store.promised_bytes(self.batch_size * self.kv_heads, self.head_dim, self.value_dim, dtype)
        # scores, positions, sinks; the scorer's own (the newest queries)
        bookkeeping = self.slots.nbytes() + self.scorer.nbytes()
        if self.padding is not None:  # pads and real_seen (a head store counts its rows' real tokens itself)
            bookkeeping += self.padding.nbytes()
        bookkeeping += self.eviction.nbytes() + self.finite.nbytes()
        return round(stored + bookkeeping)  # a per-token rate may be a fraction (a latent shared by KV heads)

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]  # transformers' class flag; here it depends on the state
        return self.seen == self.stored_tokens and not self.per_head

    def reset(self) -> None:
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        indices = torch.as_tensor(indices, device=self.device)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        assert self.store is not None  # set with `is_initialized`
        self.store.select_rows(indices)
        self.eviction.select_rows(indices)
        self.slots.select_rows(indices)
        if self.padding is not None:
            self.padding.select_rows(indices)
        self.scorer.select_rows(indices)
        self.batch_size = indices.numel()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        index = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
        self.batch_select_indices(index)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the `-tokens_to_remove` newest tokens (transformers >= 5.24: 0 or negative; generate() calls
        `crop(0)` when every draft token was accepted). Only possible while nothing was evicted."""
        if tokens_to_remove > 0:
            raise ValueError(
                "tokens_to_remove must be 0 or negative (minus the number of newest tokens to drop), "
                f"got {tokens_to_remove}"
            )
        if not self.is_initialized or tokens_to_remove == 0:
            return
        keep = self.seen + tokens_to_remove
        if keep < 0:
            raise ValueError(f"tokens_to_remove={tokens_to_remove} would drop more than the {self.seen} tokens seen")
        if not self.is_croppable:
            raise ValueError(
                f"cannot crop this cache: {type(self.policy).__name__} has already evicted tokens, so the cropped "
                "state cannot be rebuilt"
            )
        if keep < self.n_encoded and self.codec.token_block("key") > 1:
            raise ValueError(
                f"cannot crop to {keep} tokens: {self.n_encoded} tokens are already encoded in groups of "
                f"{self.codec.token_block('key')}; crop only within the last {self.seen - self.n_encoded} tokens"
            )
        # Croppable: a token layer (`is_croppable` is False for a head store) that has seen a step.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        self.store.crop(keep)
        self.slots.crop(keep)
        self.scorer.crop(keep, self.seen)
        self.seen = keep
        self.padding.crop(keep)
