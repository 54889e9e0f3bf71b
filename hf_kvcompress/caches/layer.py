"""One decoder layer's compressed cache: a policy (which tokens stay) x a codec (how they are stored)."""

from __future__ import annotations

import warnings
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.base import Codec, Encoded, agree_within_groups, cat_encoded, gather_encoded, select_batch
from ..ops.rerotate import rerotate
from ..policies.base import Policy, drop_one, select_kept
from .store_attention import attend_store

# The key under which a layer asks the attention function for statistics (see hf/attention.py).
OBSERVER_KEY = "kvcompress_observer"
# The key under which a layer whose length differs from the other layers' hands attention its own mask.
MASK_KEY = "kvcompress_mask"
# The key under which a layer offers attention its encoded store, to read a block at a time.
STORE_KEY = "kvcompress_store"

# Set by generation.prefill while it feeds a prompt in chunks aligned to the prompt's end (see there).
END_ALIGNED_CHUNKS: ContextVar[bool] = ContextVar("END_ALIGNED_CHUNKS", default=False)

CHUNKS_SPLIT_PADDED_ROWS = (
    "this left-padded batch was prefilled in chunks counted from its start (generate(prefill_chunk_size=...)) and "
    "the cache evicted between chunks: each padded row's chunks start at another token than they would for the row "
    "alone, so its eviction points, and possibly its answer, differ from the row alone. Prefill with "
    "hf_kvcompress.prefill(model, input_ids, attention_mask, cache, chunk_size=...) (chunks aligned to the prompt's "
    "end: padded rows equal rows alone) or without prefill_chunk_size"
)

PADDING_SPLITS_GROUPS = (
    "per-channel key groups of {group} tokens span left padding in this batch: a row whose padding is not a "
    "multiple of {group} is quantized in other groups than when run alone, so its answer can differ slightly from "
    "the row alone; use key_axis='token' (exact row equivalence) or batch rows of equal length"
)

NON_FINITE = (
    "the model produced NaN or inf keys/values (fp16 overflow?); the cache refuses to store them, and its earlier "
    "layers already hold this step (and, for a decode step, up to {every} steps before it: decode steps are checked "
    "in batches): call cache.reset() before reusing it"
)
# Decode steps between two host reads of the deferred NaN/inf check (see CompressedLayer._check_finite).
FINITE_CHECK_EVERY = 64
NON_FINITE = NON_FINITE.format(every=FINITE_CHECK_EVERY)

ENABLE_ATTENTION_HINT = (
    "call `hf_kvcompress.use_kvcompress_attention(model)` once before generating (it registers the "
    "'kvcompress_sdpa' attention function with transformers and switches the model to it)"
)


@dataclass
class AttentionRequest:
    """What a layer asks the attention function for: statistics over some queries, reduced per key."""

    deliver: Callable[[torch.Tensor], None]  # receives [B, H_kv, kv]
    newest_queries: int | None = None  # None: every query of the step
    reduction: str = "sum"  # "sum" or "max" over queries and over the query heads of a KV group
    query_mask: torch.Tensor | None = None  # [B, q] bool: queries that count (reconstruction padding does not)


@dataclass
class StoreRequest:
    """A layer offers attention its encoded store (see caches/store_attention.py): `fused` once our attention
    function has taken an offer before (what update returned is then a placeholder); `used` is set by it."""

    layer: "CompressedLayer"
    fused: bool
    used: bool = False


@dataclass
class OwnMask:
    """A layer's own attention mask, for when transformers' shared mask does not fit what the layer keeps."""

    mask: torch.Tensor  # [B, 1, q, kv] bool
    used: bool = False  # set by the attention function (hf/attention.py): any other one ignores the mask


def _attention_kwargs(args, kwargs) -> dict | None:
    """The dict of attention kwargs transformers hands to `update` (it is later unpacked into attention)."""
    if isinstance(kwargs.get("kwargs"), dict):
        return kwargs["kwargs"]
    if args and isinstance(args[0], dict):
        return args[0]
    return None


class CompressedLayer(CacheLayerMixin):
    """Stores a layer's kept tokens as [encoded store | full-precision tail].

    New tokens join the tail; the policy evicts down to its budget (right away, or after attention when it
    scores by attention); tail tokens beyond the codec's residual are encoded a block at a time and never
    re-encoded. Slots stay in token order with each row's padding first, so `get_mask_sizes` lets transformers'
    own masks line up with what is kept, and the standard attention functions work unchanged.
    """

    is_compileable = False

    def __init__(self, policy: Policy, codec: Codec, is_sliding: bool = False, inv_freq: torch.Tensor | None = None):
        """`inv_freq` (RoPE frequencies) turns on StreamingLLM's re-rotation: after each eviction, kept keys are
        re-rotated so that their distances to the next query are their distances in the cache."""
        super().__init__()
        self.policy = policy
        self.codec = codec
        self.is_sliding = is_sliding
        self.inv_freq = inv_freq
        if inv_freq is not None and not (codec.lossless and policy.evicts):
            raise ValueError("rerotate needs an evicting policy and full-precision keys (codec 'identity')")
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None  # unused: kept for code that inspects transformers layers
        self.is_initialized = False
        self.seen = 0  # tokens this layer has been given, evicted ones included
        self.encoded_keys: Encoded | None = None
        self.encoded_values: Encoded | None = None
        self.n_encoded = 0
        self.tail_keys: torch.Tensor | None = None  # [B, H_kv, t, D]
        self.tail_values: torch.Tensor | None = None
        self.pads: torch.Tensor | None = None  # [B] padding slots kept at the front of each row
        self.real_seen: torch.Tensor | None = None  # [B] real (non-padding) tokens seen per row
        self.padding_unknown = False  # a batch fed without per-row position ids: its padding cannot be counted
        self.accumulated: torch.Tensor | None = None  # [B, H_kv, T] attention received, for scoring policies
        self.positions: torch.Tensor | None = None  # [B, H_kv, T] position each kept key is rotated to (rerotate)
        self.peak_tokens = 0  # most tokens held at once, the step's new ones included
        # The codec's `sink_tokens` first real tokens of each row, kept exactly: slot [B, H_kv, S] (-1: none) and
        # states [B, H_kv, S, D]; they overwrite their decoded slots (see `_capture_sinks`).
        self.sink_slots: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.awaiting_attention = False
        self.reconstruction_queries: torch.Tensor | None = None  # [B, q] while a reconstruction pass runs
        self.scored = False  # a reconstruction pass has scored the kept slots (KVzip)
        self.budget_shift: torch.Tensor | None = None  # [B] tokens this layer keeps beyond the uniform budget
        self.own_mask: OwnMask | None = None  # the mask handed to attention at the last step, if any
        self.step_tokens = 0  # tokens of the step being stored
        self.evicted_mid_prompt = False  # evicted after a multi-token step that more prompt chunks may follow
        self.finite: torch.Tensor | None = None  # device flag: decode steps since the last check were finite
        self.unchecked_steps = 0
        self.mask_misplaced = True  # the last `_shared_mask_misplaces_padding` answer (True: ask again)
        self.store_request: StoreRequest | None = None  # the store offered to attention at the last step
        self.store_confirmed = False  # our attention function took the store at the last step it was offered

    # -- transformers' layer contract -------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size, self.kv_heads, _, self.head_dim = key_states.shape
        self.value_dim = value_states.shape[-1]
        self.codec.check_head_dim(self.head_dim)
        self.codec.check_head_dim(self.value_dim)
        self.pads = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        self.real_seen = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
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
                f"this cache holds a batch of {self.batch_size} rows, got {batch}: call cache.reset() first"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new states; return everything attention may see this step (kept before + new)."""
        if self.is_initialized:
            self._check_shape(key_states, value_states)  # device, heads and batch first: the check below reads values
        self._check_finite(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.awaiting_attention:
            raise RuntimeError(f"{type(self.policy).__name__} scores tokens by attention: {ENABLE_ATTENTION_HINT}")
        self.check_mask_used()
        self.check_store_used()
        attn_kwargs = _attention_kwargs(args, kwargs)
        if self.reconstruction_queries is not None:
            return self._reconstruction_step(key_states, value_states, attn_kwargs)
        new = key_states.shape[-2]
        if self.policy.scores_by_reconstruction and not self.scored and new == 1 and self._over_budget():
            raise RuntimeError(
                f"{type(self.policy).__name__} compresses a prompt after reading it again: prefill it with "
                "hf_kvcompress.prefill(model, input_ids, attention_mask, cache, repeat_prompt_ids=...) (or "
                "hf_kvcompress.generation.generate), not with model.generate alone"
            )
        self._count_padding(attn_kwargs, new)
        self._check_chunk_alignment(new)
        self.seen += new

        # The model's states may be views of a fused QKV buffer (GPT-2, Phi-3): keep copies, not the buffer.
        self.tail_keys = _owned(key_states) if self.tail_keys is None else torch.cat([self.tail_keys, key_states], dim=-2)
        self.tail_values = (
            _owned(value_states) if self.tail_values is None else torch.cat([self.tail_values, value_states], dim=-2)
        )
        length = self.stored_tokens
        self.peak_tokens = max(self.peak_tokens, length)
        if self.inv_freq is not None or self.policy.needs_positions:
            self._track_positions(attn_kwargs, new)

        if self.budget_shift is not None or self._shared_mask_misplaces_padding(length):
            self._own_mask(attn_kwargs, new, length)
        if self.policy.needs_attention:
            self._grow_accumulated(new)
            self._request_attention(attn_kwargs, AttentionRequest(
                self.observe, self.policy.observed_queries, self.policy.attention_reduction
            ))
            return self._full("key"), self._full("value")
        if self.scored:  # tokens after a reconstruction pass rank above the context, newest first
            self._grow_accumulated(new, fill_from=2.0 + self.seen)
        if self._may_attend_store(attn_kwargs, new):
            self.store_request = StoreRequest(self, fused=self.store_confirmed)
            attn_kwargs[STORE_KEY] = self.store_request
            if self.store_confirmed:
                # Our attention function reads the store block by block and then calls `_compress` (the step's
                # attention must see the state before eviction and encoding). What update returns is never read:
                # placeholders that cost nothing and are NaN, so that any other attention function fails loudly
                # (and the next update raises).
                placeholder = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
                return (
                    placeholder.expand(self.batch_size, self.kv_heads, length, self.head_dim),
                    placeholder.expand(self.batch_size, self.kv_heads, length, self.value_dim),
                )
        full_keys, full_values = self._full("key"), self._full("value")
        self._compress()
        return full_keys, full_values

    def _may_attend_store(self, attn_kwargs: dict | None, new: int) -> bool:
        """Whether this decode step can let attention read the encoded store itself (caches/store_attention.py)."""
        return (
            new == 1 and attn_kwargs is not None and self.encoded_keys is not None and self.codec.attends_encoded
            and self.inv_freq is None and self.reconstruction_queries is None
        )

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Called by our attention function for a fused step: attention over what this layer holds, then the
        step's eviction and encoding."""
        output = attend_store(self, query, attention_mask, scaling)
        self._compress()
        return output

    def check_store_used(self) -> None:
        """After a step that offered attention the store: learn whether our attention function took it."""
        request, self.store_request = self.store_request, None
        if request is None:
            return
        if request.fused and not request.used:
            self.store_confirmed = False
            raise RuntimeError(
                "the last decode step's attention did not run through 'kvcompress_sdpa', which this cache had "
                "relied on (the attention implementation changed mid-generation?): that step's output is invalid; "
                "call cache.reset() and generate again"
            )
        self.store_confirmed = request.used

    def _check_finite(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse NaN/inf states. A multi-token step (a prompt) is checked at once; a decode step only folds its
        check into a flag on the device, read every `FINITE_CHECK_EVERY` steps and when the cache is saved: reading
        a value on the host at every step of every layer stalls a GPU's launch queue, and a non-finite decode step
        shows in that step's logits anyway."""
        if key_states.element_size() == 1:  # float8 states: no inf, and NaN checks are not implemented for them
            return
        finite = key_states.isfinite().all() & value_states.isfinite().all()
        if key_states.shape[-2] == 1:
            self.finite = finite if self.finite is None else self.finite & finite
            self.unchecked_steps += 1
            if self.unchecked_steps < FINITE_CHECK_EVERY:
                return
            finite, self.finite = self.finite, None
        self.unchecked_steps = 0
        if not bool(finite):
            raise ValueError(NON_FINITE)

    def _flush_finite_check(self) -> None:
        """Read the deferred decode-step check now."""
        if self.finite is not None:
            finite, self.finite, self.unchecked_steps = self.finite, None, 0
            if not bool(finite):
                raise ValueError(NON_FINITE)

    def _check_chunk_alignment(self, new: int) -> None:
        """Warn when a padded batch's prompt chunks, counted from its start, split rows unlike the rows alone."""
        self.step_tokens = new
        if new == 1:
            self.evicted_mid_prompt = False
            return
        if not self.evicted_mid_prompt or END_ALIGNED_CHUNKS.get() or self.batch_size == 1:
            return
        padding = self.seen - self.real_seen
        if bool((padding != padding[0]).any()):
            warnings.warn(CHUNKS_SPLIT_PADDED_ROWS, UserWarning, stacklevel=3)
        self.evicted_mid_prompt = False

    def _shared_mask_misplaces_padding(self, length: int) -> bool:
        """Whether transformers' mask, built from the 2-D padding mask and one offset for the whole batch, masks
        other slots than the padding this layer keeps. It fits while each padded row keeps all its real tokens (a
        fixed budget); a ratio makes a padded row keep a share of them and some padding, which it cannot express."""
        if self.budget_shift is None and self.policy.ratio is None and self.step_tokens == 1 and not self.mask_misplaced:
            # A decode step adds one slot and one token seen to every row (offset unchanged) and moves padding and
            # real counts alike, so the answer holds from the last step; a fixed budget (or none) also keeps it
            # false through eviction (each row keeps min(budget, real) real slots behind its padding). Not asking
            # again saves a host read per layer per step.
            return False
        offset = self.seen - length  # tokens seen minus slots attention sees, the same for every row
        expected = (self.seen - self.real_seen - offset).clamp(min=0, max=length)
        self.mask_misplaced = bool((expected != self.pads).any())
        return self.mask_misplaced

    def _own_mask(self, attn_kwargs: dict | None, new: int, length: int) -> None:
        """Give attention this layer's [B, 1, new, length] mask (its padding first, causal over the new tokens):
        transformers' one mask cannot fit when layers keep different numbers of tokens or rows different shares."""
        if attn_kwargs is None:
            raise RuntimeError("this cache needs the attention kwargs that transformers passes to cache layers")
        slot = torch.arange(length, device=self.device)
        query_slot = length - new + torch.arange(new, device=self.device)
        allowed = (slot[None, :] <= query_slot[:, None])[None] & (slot[None, :] >= self.pads[:, None])[:, None, :]
        self.own_mask = OwnMask(allowed[:, None])
        attn_kwargs[MASK_KEY] = self.own_mask

    def check_mask_used(self) -> None:
        """Refuse to go on when the last step's own mask was ignored (the model does not use our attention)."""
        if self.own_mask is not None and not self.own_mask.used:
            self.own_mask = None
            raise RuntimeError(
                f"{type(self.policy).__name__} with a ratio in a padded batch (or per-layer budgets) keeps what "
                f"transformers' shared attention mask cannot describe: {ENABLE_ATTENTION_HINT}"
            )
        self.own_mask = None

    def _request_attention(self, attn_kwargs: dict | None, request: AttentionRequest) -> None:
        if attn_kwargs is None:
            raise RuntimeError(
                f"{type(self.policy).__name__} needs the attention kwargs that transformers passes to cache "
                "layers; this model does not pass them"
            )
        attn_kwargs[OBSERVER_KEY] = request
        self.awaiting_attention = True

    def observe(self, attention: torch.Tensor) -> None:
        """Receive [B, H_kv, kv] attention statistics for this step's queries, then evict and encode."""
        self.accumulated = self.policy.observe(self.accumulated, attention.to(self.accumulated.dtype))
        self.awaiting_attention = False
        self._compress()

    # -- reconstruction (KVzip): the model reads the context again; its queries score the kept slots ------------

    def begin_reconstruction(self) -> None:
        if self.is_initialized and self.policy.scores_by_reconstruction:
            self.accumulated = torch.zeros(
                self.batch_size, self.kv_heads, self.stored_tokens, device=self.device, dtype=torch.float32
            )

    def _reconstruction_step(self, key_states, value_states, attn_kwargs):
        """Attend over kept + reconstruction tokens, keep nothing new, and take the max attention per kept slot."""
        self._check_shape(key_states, value_states)
        full_keys = torch.cat([self._full("key"), key_states], dim=-2)
        full_values = torch.cat([self._full("value"), value_states], dim=-2)
        self.peak_tokens = max(self.peak_tokens, full_keys.shape[-2])
        if self.policy.scores_by_reconstruction:
            self._request_attention(attn_kwargs, AttentionRequest(
                self._observe_reconstruction, None, "max", self.reconstruction_queries
            ))
        return full_keys, full_values

    def _observe_reconstruction(self, attention: torch.Tensor) -> None:
        stored = self.accumulated.shape[-1]
        self.accumulated = torch.maximum(self.accumulated, attention[..., :stored].to(torch.float32))
        self.awaiting_attention = False

    def end_reconstruction(self) -> None:
        """Evict the lowest-scored slots down to the budget."""
        self.reconstruction_queries = None
        if self.is_initialized and self.policy.scores_by_reconstruction:
            self.scored = True
            self._compress()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored_tokens
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.policy.budget is None else self.policy.budget  # a ratio does not bound the length

    @property
    def stored_tokens(self) -> int:
        tail = 0 if self.tail_keys is None else self.tail_keys.shape[-2]
        return self.n_encoded + tail

    def promised_bytes(self) -> int:
        """Bytes this layer should hold, from what it keeps: encoded tokens at the codec's rate, the tail at full
        precision, plus its bookkeeping (padding counts, attention scores, positions). Tests compare this with
        `measured_kv_bytes`, which reads the real storage."""
        if not self.is_initialized:
            return 0
        rows = self.batch_size * self.kv_heads
        encoded = self.n_encoded * (
            self.codec.bytes_per_token(self.head_dim, "key", self.dtype)
            + self.codec.bytes_per_token(self.value_dim, "value", self.dtype)
        )
        element = torch.empty((), dtype=self.dtype).element_size()
        tail = (self.stored_tokens - self.n_encoded) * (self.head_dim + self.value_dim) * element
        bookkeeping = 2 * self.batch_size * 8  # pads and real_seen, int64 per row
        for extra in (
            self.accumulated, self.positions, self.budget_shift, self.sink_slots, self.sink_keys, self.sink_values,
            self.finite,
        ):
            if extra is not None:
                bookkeeping += extra.numel() * extra.element_size()
        return int(rows * (encoded + tail) + bookkeeping)

    @property
    def is_croppable(self) -> bool:
        return self.seen == self.stored_tokens

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
        self.encoded_keys = select_batch(self.encoded_keys, indices)
        self.encoded_values = select_batch(self.encoded_values, indices)
        for name in self.STATE_TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, indices))
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
                f"tokens_to_remove must be 0 or negative (minus the number of newest tokens to drop), got {tokens_to_remove}"
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
        if keep < self.n_encoded:
            index = torch.arange(keep, device=self.device).expand(self.batch_size, self.kv_heads, keep)
            self.encoded_keys = gather_encoded(self.encoded_keys, index)
            self.encoded_values = gather_encoded(self.encoded_values, index)
            self.n_encoded = keep
        tail_keep = keep - self.n_encoded
        self.tail_keys = _owned(self.tail_keys[:, :, :tail_keep])
        self.tail_values = _owned(self.tail_values[:, :, :tail_keep])
        if self.accumulated is not None:
            self.accumulated = _owned(self.accumulated[..., :keep])
        if self.positions is not None:
            self.positions = _owned(self.positions[..., :keep])
        if self.sink_slots is not None:
            self.sink_slots = self.sink_slots.masked_fill(self.sink_slots >= keep, -1)
        self.seen = keep
        self.pads = self.pads.clamp(max=keep)
        self.real_seen = keep - self.pads

    # -- saving and loading (see caches/persist.py) ----------------------------------------------------------------

    STATE_TENSORS = (
        "tail_keys", "tail_values", "pads", "real_seen", "accumulated", "positions", "budget_shift",
        "sink_slots", "sink_keys", "sink_values",
    )
    STATE_SCALARS = ("seen", "n_encoded", "peak_tokens", "batch_size", "kv_heads", "head_dim", "value_dim", "scored")

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This layer's tensors by name, and the numbers that describe them, for `save_cache`."""
        if self.awaiting_attention:
            raise RuntimeError("cannot save a cache layer in the middle of a step (it awaits attention statistics)")
        self._flush_finite_check()
        tensors = {name: getattr(self, name) for name in self.STATE_TENSORS if getattr(self, name) is not None}
        for kind, encoded in (("key", self.encoded_keys), ("value", self.encoded_values)):
            for name, tensor in (encoded or {}).items():
                tensors[f"encoded_{kind}.{name}"] = tensor
        meta = {name: getattr(self, name) for name in self.STATE_SCALARS}
        meta.update(dtype=str(self.dtype).removeprefix("torch."), padding_unknown=self.padding_unknown)
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
        """Restore what `export_state` returned, on `device`."""
        self._clear()
        for name in self.STATE_SCALARS:
            setattr(self, name, int(meta[name]))
        self.dtype = getattr(torch, meta["dtype"])
        self.padding_unknown = bool(meta["padding_unknown"])
        self.device = torch.device(device)
        for name in self.STATE_TENSORS:
            if name in tensors:
                setattr(self, name, tensors[name].to(self.device, copy=True))
        for kind in ("key", "value"):
            prefix = f"encoded_{kind}."
            encoded = {k[len(prefix):]: t.to(self.device, copy=True) for k, t in tensors.items() if k.startswith(prefix)}
            setattr(self, f"encoded_{kind}s", encoded or None)
        self.device = self.pads.device  # "cuda" resolves to "cuda:0", as the model's states will say
        self.is_initialized = True

    # -- internals -------------------------------------------------------------------------------------------------

    def _full(self, kind: str) -> torch.Tensor:
        """What attention sees: the decoded store followed by the full-precision tail."""
        encoded = self.encoded_keys if kind == "key" else self.encoded_values
        tail = self.tail_keys if kind == "key" else self.tail_values
        if encoded is None:
            return tail
        decoded = self.codec.decode(encoded, kind, self.dtype)
        if self.sink_slots is not None:
            decoded = self._restore_sinks(decoded, self.sink_keys if kind == "key" else self.sink_values)
        return torch.cat([decoded, tail], dim=-2)

    def _capture_sinks(self) -> None:
        """Copy each row's first `codec.sink_tokens` real tokens before anything is encoded or evicted, while the
        tail still holds every token in order; real tokens not seen by then (a row still all padding) are not kept."""
        sinks = self.codec.sink_tokens
        if sinks == 0 or self.sink_slots is not None or self.stored_tokens != self.seen:
            return
        offset = torch.arange(sinks, device=self.device)
        slots = torch.where(offset < self.real_seen[:, None], self.pads[:, None] + offset, -1)  # [B, S]
        slots = slots[:, None, :].expand(self.batch_size, self.kv_heads, sinks).contiguous()
        self.sink_slots = slots
        self.sink_keys = _gather_states(self.tail_keys, slots.clamp(min=0))
        self.sink_values = _gather_states(self.tail_values, slots.clamp(min=0))

    def _restore_sinks(self, decoded: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """`decoded` [B, H, n, D] with the sink slots it holds replaced by their exact states."""
        n = decoded.shape[-2]
        slots = torch.where((self.sink_slots >= 0) & (self.sink_slots < n), self.sink_slots, n)  # n: a spare slot
        spare = decoded.new_zeros(*decoded.shape[:2], 1, decoded.shape[-1])
        padded = torch.cat([decoded.expand(*slots.shape[:2], n, -1), spare.expand(*slots.shape[:2], 1, -1)], dim=-2)
        padded = padded.scatter(2, slots[..., None].expand(*slots.shape, decoded.shape[-1]), exact.to(decoded.dtype))
        return padded[:, :, :n]

    def _follow_sinks(self, kept: torch.Tensor) -> None:
        """After eviction keeps slots `kept` [B, H, K] (ascending), a sink's new slot is its rank in `kept`."""
        if self.sink_slots is None:
            return
        match = kept[..., None, :] == self.sink_slots[..., :, None]  # [B, H, S, K]
        self.sink_slots = torch.where(match.any(-1), match.long().argmax(-1), -1)

    def _count_padding(self, attn_kwargs: dict | None, new: int) -> None:
        """Count each row's left padding from its position ids: real tokens count up from 0, padding comes first.

        Padding sits at position 0 in transformers 5.24's generate() and at 1 in our prefill. With 0, a chunk that
        ends in padding looks like padding + a row's first token, so a row's only token stays provisional until the
        next chunk shows whether it starts again at 0 (it was padding) or goes on at 1.
        """
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != new:
            position_ids = None
        if position_ids is None or (position_ids.shape[0] == 1 and self.batch_size > 1):
            # No per-row positions (a forward without position_ids): padding, if any, cannot be told apart.
            if self.seen == 0 and self.batch_size > 1:
                self.padding_unknown = True
            self.real_seen += new
            return
        positions = position_ids.to(self.device).long()
        if new == 1:  # a decode step: the general case below, for one token, in a few operations
            at_zero = positions[:, 0] == 0
            was_padding = ((self.real_seen == 1) & at_zero).long()
            self.pads += was_padding
            self.real_seen -= was_padding
            real = ((self.real_seen > 0) | at_zero).long()
            self.pads += 1 - real
            self.real_seen += real
            return
        was_padding = (self.real_seen == 1) & (positions[:, 0] == 0)
        self.pads += was_padding.long()
        self.real_seen -= was_padding.long()
        started = self.real_seen > 0
        # The run at the chunk's end that counts up by one: the row's real tokens, unless it does not start at 0.
        counts_up = (positions[:, 1:] - positions[:, :-1]) == 1  # [B, new - 1]
        run = counts_up.flip(-1).long().cumprod(-1).sum(-1) + 1
        run_start = positions.gather(1, (new - run)[:, None]).squeeze(1)
        offset_row = (run == new) & (new > 1)  # positions that count up without padding, from any offset
        fresh = torch.where(run_start == 0, run, torch.where(offset_row, run, torch.zeros_like(run)))
        real = torch.where(started, torch.full_like(run, new), fresh)
        self.pads += new - real
        self.real_seen += real

    def _track_positions(self, attn_kwargs: dict | None, new: int) -> None:
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2:
            start = self.seen - new
            position_ids = torch.arange(start, start + new, device=self.device)[None, :]
        fresh = position_ids.to(self.device, torch.int32)[:, None, :].expand(self.batch_size, self.kv_heads, new)
        self.positions = fresh if self.positions is None else torch.cat([self.positions, fresh], dim=-1)

    def _rerotate_kept(self) -> None:
        """Re-rotate kept keys so slot i sits len(kept) - i positions before the row's next query."""
        kept = self.positions.shape[-1]
        target = self.real_seen[:, None, None] - kept + torch.arange(kept, device=self.device)
        self.tail_keys = rerotate(self.tail_keys, target - self.positions, self.inv_freq)
        self.positions = target.to(torch.int32).expand_as(self.positions).contiguous()

    def _grow_accumulated(self, new: int, fill_from: float | None = None) -> None:
        fresh = torch.zeros(self.batch_size, self.kv_heads, new, device=self.device, dtype=torch.float32)
        if fill_from is not None:
            fresh += fill_from + torch.arange(new, device=self.device, dtype=torch.float32)
        self.accumulated = fresh if self.accumulated is None else torch.cat([self.accumulated, fresh], dim=-1)

    def _keep_per_row(self) -> torch.Tensor | None:
        """Real tokens each row keeps now, [B]; None when the policy keeps everything (or waits for its scores)."""
        if not self.policy.evicts or (self.policy.scores_by_reconstruction and not self.scored):
            return None
        keep = self.policy.kept_per_row(self.real_seen)
        return keep if self.budget_shift is None else (keep + self.budget_shift).clamp(min=1)

    def _over_budget(self) -> bool:
        keep = self.policy.kept_per_row(self.real_seen) if self.policy.evicts else None
        return keep is not None and self.stored_tokens > self._most_kept(keep)

    def _most_kept(self, keep: torch.Tensor) -> int:
        """keep.max(), known on the host for a fixed budget (no host read of a device value)."""
        if self.policy.budget is not None and self.budget_shift is None:
            return self.policy.budget
        return int(keep.max())

    def _compress(self) -> None:
        keep = self._keep_per_row()
        if keep is not None:
            most = self._most_kept(keep)
            if self.stored_tokens > most:
                self._evict(keep, most)
        self._encode_tail()

    def _evict(self, keep: torch.Tensor, most: int) -> None:
        if self.padding_unknown and (self.policy.sink_tokens > 0 or self.policy.needs_attention):
            raise ValueError(
                f"this batch of {self.batch_size} rows was fed without per-row position_ids, so the cache cannot tell "
                "left padding from tokens and eviction would keep padding as attention sinks: pass "
                "position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) with the attention_mask, or use generate() "
                "or hf_kvcompress.generation.prefill"
            )
        self.evicted_mid_prompt = self.step_tokens > 1
        length = self.stored_tokens
        keys = self._full("key") if self.policy.needs_keys else None
        scores = self.policy.score(self.accumulated, length, keys=keys, positions=self.positions, pads=self.pads)
        scores = agree_within_groups(scores, self.codec.heads_per_store)
        if length == most + 1 and self.policy.budget is not None and self.budget_shift is None:
            kept = drop_one(self.policy, scores, self.pads, self.kv_heads, length)  # a decode step: one slot over
        else:
            kept = select_kept(self.policy, scores, self.pads, self.kv_heads, length, keep, most)  # [B, H_kv, budget]
        budget = kept.shape[-1]
        if self.encoded_keys is None:
            self._capture_sinks()
        self._follow_sinks(kept)
        if self.accumulated is not None:
            self.accumulated = torch.gather(self.accumulated, 2, kept)
        if self.positions is not None:
            self.positions = torch.gather(self.positions, 2, kept)
        self.pads = budget - torch.minimum(keep, length - self.pads)
        n_enc = self.n_encoded
        if self.encoded_keys is None:
            self.tail_keys = _gather_states(self.tail_keys, kept)
            self.tail_values = _gather_states(self.tail_values, kept)
            if self.inv_freq is not None:
                self._rerotate_kept()
            return
        # Rows and heads keep different numbers of tail tokens: the `in_tail` newest kept slots stay at full
        # precision everywhere; kept tail tokens older than those are encoded now, for the first and only time.
        in_tail = int((kept >= n_enc).sum(-1).min())
        to_store, to_tail = kept[..., : budget - in_tail], kept[..., budget - in_tail :] - n_enc
        store_keys = cat_encoded(self.encoded_keys, self.codec.encode(self.tail_keys, "key"))
        store_values = cat_encoded(self.encoded_values, self.codec.encode(self.tail_values, "value"))
        self.encoded_keys = gather_encoded(store_keys, to_store)
        self.encoded_values = gather_encoded(store_values, to_store)
        self.n_encoded = budget - in_tail
        self.tail_keys = _gather_states(self.tail_keys, to_tail)
        self.tail_values = _gather_states(self.tail_values, to_tail)

    def _encode_tail(self) -> None:
        """Encode tail tokens beyond the codec's full-precision residual, whole blocks at a time."""
        if self.codec.lossless and self.encoded_keys is None:
            return  # full precision: the tail is the store
        residual = getattr(self.codec, "residual_length", 0)
        block = max(self.codec.token_block("key"), self.codec.token_block("value"))
        excess = self.tail_keys.shape[-2] - residual
        n = (excess // block) * block
        if n <= 0:
            return
        # Padding grows only with prompt chunks: decode steps after the first encoding need not ask (a host read).
        first = self.encoded_keys is None
        block_k = self.codec.token_block("key")
        if block_k > 1 and (first or self.step_tokens > 1) and bool((self.pads % block_k != 0).any()):
            warnings.warn(PADDING_SPLITS_GROUPS.format(group=self.codec.token_block("key")), stacklevel=2)
        if self.encoded_keys is None:
            self._capture_sinks()
        self.encoded_keys = cat_encoded(self.encoded_keys, self.codec.encode(self.tail_keys[:, :, :n], "key"))
        self.encoded_values = cat_encoded(self.encoded_values, self.codec.encode(self.tail_values[:, :, :n], "value"))
        self.n_encoded += n
        self.tail_keys = _owned(self.tail_keys[:, :, n:])
        self.tail_values = _owned(self.tail_values[:, :, n:])


def _owned(view: torch.Tensor) -> torch.Tensor:
    """A tensor holding exactly `view`'s elements: a slice would pin its whole parent buffer in memory."""
    if view.is_contiguous() and view.untyped_storage().nbytes() == view.numel() * view.element_size():
        return view
    return view.clone(memory_format=torch.contiguous_format)


def _gather_states(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states[b, h, index[b, h, k], :] as a fresh tensor (so the evicted rows' memory is freed)."""
    if states.shape[1] == 1 and index.shape[1] > 1:
        states = states.expand(-1, index.shape[1], -1, -1)
    return torch.gather(states, 2, index[..., None].expand(*index.shape, states.shape[-1])).contiguous()
