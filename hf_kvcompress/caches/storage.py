"""A layer's kept tokens as [encoded store | full-precision tail]: the store that owns them (`TokenStore`).

New tokens join the tail at full precision; tail tokens beyond the codec's residual are encoded a block at a time
and never re-encoded. A stack (`lowrank+int4`) holds its storage's residual between the two, reduced but not yet
encoded (`held`: lowrank's latents at full precision), so that only the reduction's own window is whole vectors.
Attention sees the decoded store (encoded, then held) followed by the tail; the codec's exact sink tokens
(codec_sinks.py) and a padded batch's exact rows (eviction.py) overwrite their decoded slots when it is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codecs.base import Codec, Encoded, Kind, cat_encoded, gather_encoded, select_batch, slice_encoded
from ..ops.rerotate import rerotate
from .encoded_room import EncodedRoom

# A sliding window's room holds one slot beyond its kept slots per this many of them: the window is copied once every
# that many decode steps, and the store holds that share more (`TokenStore.slide`); shorter windows gather.
KEPT_PER_ROOM_SLOT = 32


def owned(view: torch.Tensor) -> torch.Tensor:
    """A tensor holding exactly `view`'s elements: a slice would pin its whole parent buffer in memory."""
    if view.is_contiguous() and view.untyped_storage().nbytes() == view.numel() * view.element_size():
        return view
    return view.clone(memory_format=torch.contiguous_format)


def gather_states(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states[b, h, index[b, h, k], :] as a fresh tensor (so the evicted rows' memory is freed).

    Each kept token is a contiguous row of D values: `index_select` over the [B * H * T, D] rows copies them whole,
    ~9x faster on CPU than `torch.gather` with an index expanded over D (which an evicting policy paid for keys and
    values at every decode step)."""
    batch, heads, length, dim = states.shape
    if heads == 1 and index.shape[1] > 1:
        states = states.expand(-1, index.shape[1], -1, -1)
        return torch.gather(states, 2, index[..., None].expand(*index.shape, dim)).contiguous()
    rows = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * length + index
    return states.reshape(-1, dim).index_select(0, rows.reshape(-1)).view(*index.shape, dim)


def _owned_encoded(encoded: Encoded, start: int, end: int, tokens: int) -> Encoded:
    """Tokens [start, end) of an encoding as tensors of their own (a view would pin the dropped blocks)."""
    return {name: owned(t) for name, t in slice_encoded(encoded, start, end, tokens).items()}


class TokenStore:
    """One layer's stored states; only this object assigns them (the layer builds it at its first step).

    `encoded_keys` / `encoded_values`: the codec's encoding of the `n_encoded` oldest slots (None: nothing encoded),
    views of a room with spare slots (encoded_room.py) into which each step's newly encoded tokens are written in
    place: a decode step copies no stored token;
    `held_keys` / `held_values`: the `n_held` slots after those, as the codec's `residual_codec` holds them (a stack's
    storage residual: the reduced states at full precision; None: none), encoded from there (`encode_residual`) a
    block at a time once they leave the residual;
    `tail_keys` / `tail_values` [B, H_kv, t, D]: the newest slots, at full precision;
    `sink_keys` / `sink_values` [B, H_kv, S, D]: the codec's exact sink tokens (their slots are the layer's
    `slots.sink_slots`, which move with the slots; codec_sinks.py);
    `exact_rows` [B] and `exact_keys` / `exact_values` [B, H_kv, X, D]: rows of a padded batch that keep more of their
    newest tokens at full precision than the tail holds: row b's last `exact_rows[b]` encoded slots before the tail,
    as the last of `exact_keys` / `exact_values`, overwrite their decoded form (`take`).

    A window that slides one token per decode step (`slide`) holds its tail in a room: buffers a few slots longer
    than the tail, of which the tail is a view. Each step appends in place and the window moves one slot up, so a
    steady step copies no kept token; once the room is full the window is copied to a fresh room (one copy every
    `KEPT_PER_ROOM_SLOT` steps). The room is what the store holds, and its bytes are what `promised_bytes` counts;
    so are the encoded store's spare slots.
    """

    per_head = False  # every KV head holds the same slots (a head store's heads differ: head_store.py)
    # `TENSORS`, set in `__init__` (None: not held); the three exact_* are set and cleared together. `tail_keys` and
    # `tail_values` are properties over `_tail` (below).
    sink_keys: torch.Tensor | None
    sink_values: torch.Tensor | None
    exact_rows: torch.Tensor | None
    exact_keys: torch.Tensor | None
    exact_values: torch.Tensor | None
    # Saved (and reordered by batch row) under these names; the encodings as `encoded_key.*`, `encoded_value.*`.
    TENSORS = ("tail_keys", "tail_values", "sink_keys", "sink_values", "exact_rows", "exact_keys", "exact_values")

    def __init__(self, codec: Codec, dtype: torch.dtype):
        self.codec = codec
        self.dtype = dtype
        # The encoded keys and values (`encoded_keys`, `encoded_values`), set together by `_set_encoded` and grown
        # by `encode_tail`; None: nothing encoded.
        self._encoded: tuple[EncodedRoom, EncodedRoom] | None = None
        self.n_encoded = 0
        # The stack's reduction alone (codecs/base.py `residual_codec`; None: the tail holds the whole residual) and
        # the keys and values it holds (`held_keys`, `held_values`), set together; None: none held.
        self.residual_codec = codec.residual_codec
        self._held: tuple[Encoded, Encoded] | None = None
        self._tail: list[torch.Tensor | None] = [None, None]  # `tail_keys`, `tail_values` [B, H_kv, t, D]
        # A sliding window's room (`slide`): key and value buffers [B, H_kv, capacity, D] whose slots `room_start` ..
        # `room_start + t - 1` are the tail; None when the tail is a tensor of its own.
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        self._room_start = 0
        # A slide not yet made (`slide`): which rows move their sinks [B] bool, and how many sinks; made by `_settle`
        # before anything reads or extends the tail.
        self._pending: tuple[torch.Tensor, int] | None = None
        for name in self.TENSORS:
            setattr(self, name, None)

    # -- the tail, read through the pending slide ------------------------------------------------------------------

    @property
    def tail_keys(self) -> torch.Tensor | None:
        self._settle()
        return self._tail[0]

    @tail_keys.setter
    def tail_keys(self, tensor: torch.Tensor | None) -> None:
        self._settle()
        self._tail[0], self._room = tensor, None  # a tail of its own: the room (if any) is released

    @property
    def tail_values(self) -> torch.Tensor | None:
        self._settle()
        return self._tail[1]

    @tail_values.setter
    def tail_values(self, tensor: torch.Tensor | None) -> None:
        self._settle()
        self._tail[1], self._room = tensor, None

    # -- the encoded store ------------------------------------------------------------------------------------------

    @property
    def encoded_keys(self) -> Encoded | None:
        return None if self._encoded is None else self._encoded[0].encoded

    @property
    def encoded_values(self) -> Encoded | None:
        return None if self._encoded is None else self._encoded[1].encoded

    @property
    def held_keys(self) -> Encoded | None:
        return None if self._held is None else self._held[0]

    @property
    def held_values(self) -> Encoded | None:
        return None if self._held is None else self._held[1]

    @property
    def n_held(self) -> int:
        """Slots held by `residual_codec`, after the encoded ones (token-wise: axis 2 of any of its tensors)."""
        return 0 if self._held is None else next(iter(self._held[0].values())).shape[2]

    @property
    def holds_encoded(self) -> bool:
        """Some slot is encoded or held reduced (attention reads them from the store, not from the tail)."""
        return self._encoded is not None or self._held is not None

    def _set_held(self, keys: Encoded | None, values: Encoded | None) -> None:
        """Hold `keys` and `values` (`residual_codec`'s encodings of the same slots; None: none), each tensor owned."""
        if keys is None or values is None:
            self._held = None
            return
        self._held = ({n: owned(t) for n, t in keys.items()}, {n: owned(t) for n, t in values.items()})

    @property
    def encoded_slots(self) -> int:
        """Token slots the encoded store holds, its room's spare ones included (what `promised_bytes` counts)."""
        return 0 if self._encoded is None else self._encoded[0].capacity

    def _set_encoded(self, keys: Encoded | None, values: Encoded | None, tokens: int, keep_room: bool = False) -> None:
        """Replace the encoded store by `keys` and `values`, encodings of `tokens` slots: with `keep_room`, in a room
        of the old room's size where it holds them (an eviction, a block window's drop, a beam's reorder: a cache
        that evicts and grows in turn keeps its bytes), else without spare slots (the next `encode_tail` grows a
        room; a crop or a load holds what it keeps)."""
        if keys is None or values is None or tokens == 0:
            self._encoded, self.n_encoded = None, 0
            return
        capacity = self.encoded_slots if keep_room else None
        self._encoded = (EncodedRoom(keys, tokens, capacity), EncodedRoom(values, tokens, capacity))
        self.n_encoded = tokens

    @property
    def stored_tokens(self) -> int:
        return self.n_encoded + self.n_held + self.tail_tokens

    @property
    def view_tokens(self) -> int:
        """Slots attention reads (`full`): every stored slot."""
        return self.stored_tokens

    @property
    def tail_tokens(self) -> int:
        """Slots of the tail, a pending slide's dropped one left out (counting makes no slide)."""
        tail = self._tail[0]
        return 0 if tail is None else tail.shape[-2] - (self._pending is not None)

    # -- new tokens and what attention reads ----------------------------------------------------------------------

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New states join the tail. The model's states may be views of a fused QKV buffer (GPT-2, Phi-3): keep
        copies, not the buffer. A sliding window's room takes them in place while it has room (`slide`)."""
        self._settle()
        new = key_states.shape[-2]
        if self._room is not None and self._room_start + self.tail_tokens + new <= self._room[0].shape[-2]:
            start, end = self._room_start, self._room_start + self.tail_tokens
            for room, states in zip(self._room, (key_states, value_states), strict=True):
                room[:, :, end : end + new] = states
            self._tail = [room[:, :, start : end + new] for room in self._room]
            return
        self.tail_keys = (
            owned(key_states) if self.tail_keys is None else torch.cat([self.tail_keys, key_states], dim=-2)
        )
        self.tail_values = (
            owned(value_states) if self.tail_values is None else torch.cat([self.tail_values, value_states], dim=-2)
        )

    def _at(self, kind: Kind, positions: torch.Tensor | None, start: int, end: int) -> dict[str, torch.Tensor]:
        """The keywords a codec that `needs_positions` encodes or decodes slots [start, end) of `kind` with."""
        if kind != "key" or not self.codec.needs_positions:
            return {}
        if positions is None:
            raise RuntimeError(f"{type(self.codec).__name__} stores keys with their positions: pass positions=")
        return {"positions": positions[:, :, start:end]}

    def full(self, kind: Kind, sink_slots: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """What attention sees: the decoded store (exact sinks at `sink_slots`, exact rows) followed by the tail.
        `positions` [B, H_kv, slots]: each slot's key position, for a codec that `needs_positions`."""
        encoded = self.encoded_keys if kind == "key" else self.encoded_values
        held = self.held_keys if kind == "key" else self.held_values
        tail = self.tail_keys if kind == "key" else self.tail_values
        assert tail is not None  # appended at the layer's first step, before attention reads
        if encoded is None and held is None:
            return tail
        parts = []
        if encoded is not None:
            parts.append(self.codec.decode(encoded, kind, self.dtype, **self._at(kind, positions, 0, self.n_encoded)))
        if held is not None:
            assert self.residual_codec is not None  # held only by a codec that has one
            start = self.n_encoded
            parts.append(self.residual_codec.decode(held, kind, self.dtype,
                                                    **self._at(kind, positions, start, start + self.n_held)))
        decoded = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        if sink_slots is not None:
            sinks = self.sink_keys if kind == "key" else self.sink_values
            assert sinks is not None  # captured with `sink_slots` (codec_sinks.py)
            decoded = _restore_sinks(decoded, sinks, sink_slots)
        exact = self.exact_keys if kind == "key" else self.exact_values
        if exact is not None:
            decoded = self._restore_exact(decoded, exact)
        return torch.cat([decoded, tail], dim=-2)

    def _restore_exact(self, decoded: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """`decoded` [B, H, n, D] with the last `exact_rows[b]` of its slots given their exact states."""
        extra = exact.shape[-2]
        assert self.exact_rows is not None  # set with the exact states
        mine = torch.arange(extra, device=decoded.device) >= (extra - self.exact_rows)[:, None]  # [B, X]
        newest = torch.where(mine[:, None, :, None], exact.to(decoded.dtype), decoded[:, :, -extra:])
        return torch.cat([decoded[:, :, :-extra], newest], dim=-2)

    def encoded_whole(self, kind: Kind, positions: torch.Tensor | None = None) -> Encoded | None:
        """Every stored token as one token-wise encoding [B, H, T, ...]: the encoded part, then the tail encoded now
        (for eviction, which gathers from both at once; the tail itself is left as it is)."""
        assert self._held is None  # the callers fold what is held into the tail first (`unreduce`)
        encoded = self.encoded_keys if kind == "key" else self.encoded_values
        tail = self.tail_keys if kind == "key" else self.tail_values
        at = self._at(kind, positions, self.n_encoded, self.stored_tokens)
        fresh = self.codec.encode(tail, kind, **at) if tail is not None and tail.shape[-2] else None
        if encoded is None:
            return fresh
        return encoded if fresh is None else cat_encoded(encoded, fresh)

    def capture_sinks(self, slots: torch.Tensor) -> None:
        """Copy the exact states of the tail's `slots` [B, H_kv, S] (-1: none), the codec's sink tokens."""
        assert self.tail_keys is not None and self.tail_values is not None  # appended at the layer's first step
        self.sink_keys = gather_states(self.tail_keys, slots.clamp(min=0))
        self.sink_values = gather_states(self.tail_values, slots.clamp(min=0))

    # -- encoding ---------------------------------------------------------------------------------------------------

    def encode_tail(self, before_encoding: Callable[[bool], None], positions: torch.Tensor | None = None) -> None:
        """Encode tail tokens beyond the codec's full-precision residual, whole blocks at a time.
        `before_encoding(first)` runs before any tokens are encoded (`first`: none were before); `positions`
        [B, H_kv, slots]: each slot's key position, for a codec that `needs_positions`."""
        if self.codec.lossless and self.encoded_keys is None:
            return  # full precision: the tail is the store
        assert self.tail_keys is not None and self.tail_values is not None  # appended at the layer's first step
        if self.residual_codec is not None and self.exact_keys is None:
            self._encode_through_held(before_encoding, positions)
            return
        # A stack whose padded rows hold exact states (after an eviction) encodes its tail whole until they are gone,
        # as before `held` existed (`take` folds what is held into the tail).
        residual = self.codec.exact_residual
        block = max(self.codec.token_block("key"), self.codec.token_block("value"))
        excess = self.tail_keys.shape[-2] - residual
        n = (excess // block) * block
        if self.exact_keys is not None:  # a row's exact tokens beyond the residual are encoded, as alone
            self._trim_exact(residual - (self.tail_keys.shape[-2] - max(n, 0)))
        if n <= 0:
            return
        before_encoding(self.encoded_keys is None)
        at = self._at("key", positions, self.n_encoded, self.n_encoded + n)
        new_keys = self.codec.encode(self.tail_keys[:, :, :n], "key", **at)
        new_values = self.codec.encode(self.tail_values[:, :, :n], "value")
        if self._encoded is None:  # the first encoding (a prompt's): held as it is, grown by the next
            self._set_encoded(new_keys, new_values, n)
        else:  # written in place into the rooms' spare slots (a full room grows first: encoded_room.py)
            for room, new in zip(self._encoded, (new_keys, new_values), strict=True):
                room.append(new, n, block)
            self.n_encoded += n
        self.tail_keys = owned(self.tail_keys[:, :, n:])
        self.tail_values = owned(self.tail_values[:, :, n:])

    def _encode_through_held(self, before_encoding: Callable[[bool], None], positions: torch.Tensor | None) -> None:
        """A stack's `encode_tail`: tail tokens beyond the reduction's own window (`whole_residual`) are reduced, one
        token at a time, into `held`; held tokens beyond the storage's residual (counted over held and tail, as the
        tail alone counted it before: the same tokens are encoded together) are encoded from there, whole blocks at
        a time."""
        assert self.tail_keys is not None and self.tail_values is not None and self.residual_codec is not None
        tail, held = self.tail_keys.shape[-2], self.n_held
        move = max(tail - self.codec.whole_residual, 0)
        block = max(self.codec.token_block("key"), self.codec.token_block("value"))
        n = min((held + tail - self.codec.exact_residual) // block * block, held + move)
        if move == 0 and n <= 0:
            return
        before_encoding(self._encoded is None and self._held is None)
        if move:
            start = self.n_encoded + held
            at = self._at("key", positions, start, start + move)
            fresh = (self.residual_codec.encode(self.tail_keys[:, :, :move], "key", **at),
                     self.residual_codec.encode(self.tail_values[:, :, :move], "value"))
            if self._held is None:
                self._set_held(*fresh)
            else:
                self._set_held(*(cat_encoded(old, new) for old, new in zip(self._held, fresh, strict=True)))
            self.tail_keys = owned(self.tail_keys[:, :, move:])
            self.tail_values = owned(self.tail_values[:, :, move:])
            held += move
        if n <= 0:
            return
        assert self._held is not None  # n <= held
        kinds: tuple[Kind, Kind] = ("key", "value")
        new_keys, new_values = (self.codec.encode_residual(slice_encoded(part, 0, n, held), kind, self.dtype)
                                for part, kind in zip(self._held, kinds, strict=True))
        if self._encoded is None:
            self._set_encoded(new_keys, new_values, n)
        else:
            for room, new in zip(self._encoded, (new_keys, new_values), strict=True):
                room.append(new, n, block)
            self.n_encoded += n
        if n == held:
            self._held = None
        else:
            self._set_held(*(_owned_encoded(part, n, held, held) for part in self._held))

    def unreduce(self, positions: torch.Tensor | None = None) -> None:
        """Fold the held slots back into the tail as whole states (decoded: what attention read), so that a move
        that sorts slots by precision (`take`, a head ranking) sees [encoded | tail] only; the next `encode_tail`
        reduces them again. `positions` [B, H_kv, slots]: each slot's key position, for a codec that
        `needs_positions`."""
        if self._held is None:
            return
        assert self.residual_codec is not None and self.tail_keys is not None and self.tail_values is not None
        start = self.n_encoded
        at = self._at("key", positions, start, start + self.n_held)
        keys = self.residual_codec.decode(self._held[0], "key", self.dtype, **at)
        values = self.residual_codec.decode(self._held[1], "value", self.dtype)
        self._held = None
        self.tail_keys = torch.cat([keys, self.tail_keys], dim=-2)
        self.tail_values = torch.cat([values, self.tail_values], dim=-2)

    def _trim_exact(self, room: int) -> None:
        """Keep exact states for the `room` newest encoded slots at most: older ones were encoded from those states
        when they joined the store, which is how the row alone stores them once they leave its residual."""
        # Called when exact states are held; the three are set together.
        assert self.exact_keys is not None and self.exact_values is not None and self.exact_rows is not None
        extra = min(self.exact_keys.shape[-2], max(room, 0))
        if extra == 0:
            self.exact_keys = self.exact_values = self.exact_rows = None
        elif extra < self.exact_keys.shape[-2]:
            self.exact_keys = owned(self.exact_keys[:, :, -extra:])
            self.exact_values = owned(self.exact_values[:, :, -extra:])
            self.exact_rows = self.exact_rows.clamp(max=extra)

    # -- moves --------------------------------------------------------------------------------------------------------

    def take(self, kept: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Keep the slots `kept` [B, H_kv, K] (ascending), which become slots 0..K-1 (eviction). `positions`
        [B, H_kv, slots]: each slot's key position before the eviction, for a codec that `needs_positions`."""
        budget = kept.shape[-1]
        self.unreduce(positions)
        n_enc = self.n_encoded
        assert self.tail_keys is not None and self.tail_values is not None  # appended at the layer's first step
        if self.encoded_keys is None:
            self.tail_keys = gather_states(self.tail_keys, kept)
            self.tail_values = gather_states(self.tail_values, kept)
            return
        # Heads keep different numbers of a row's full-precision tokens: each row keeps its `exact` newest kept slots
        # at full precision (the fewest over its heads, as alone); kept full-precision tokens older than those are
        # encoded now, for the first and only time. The tail holds the fewest any row keeps, and a row that keeps
        # more keeps the rest as exact states over its encoded slots just before the tail (`_restore_exact`): other
        # rows never change a row's precision. Padding slots count as exact: they are older than a row's real
        # tokens, so a row whose padding reaches its exact slots holds all its real tokens exactly, as alone.
        first_exact = n_enc - (0 if self.exact_rows is None else self.exact_rows)  # [B] or one slot for every row
        exact = (kept >= torch.as_tensor(first_exact, device=kept.device).view(-1, 1, 1)).sum(-1).amin(-1)  # [B]
        both = exact.max() * (budget + 1) + exact.min()  # one host read for both numbers
        most, in_tail = divmod(int(both), budget + 1)
        to_store = kept[..., : budget - in_tail]
        whole_keys, whole_values = self.encoded_whole("key", positions), self.encoded_whole("value")
        assert whole_keys is not None and whole_values is not None  # something is encoded (checked above)
        self._set_encoded(gather_encoded(whole_keys, to_store), gather_encoded(whole_values, to_store),
                          budget - in_tail, keep_room=True)
        # The `most` newest kept slots from [old exact states | tail] (slots n_enc - before ...): a row's slots older
        # than its own exact ones read another slot (clamped), and `exact_rows` leaves them unused.
        before = 0 if self.exact_keys is None else self.exact_keys.shape[-2]
        source = kept[..., budget - most :] - (n_enc - before)
        sources = [(self.tail_keys, self.exact_keys), (self.tail_values, self.exact_values)]
        states = [tail if exact_old is None else torch.cat([exact_old, tail], dim=-2) for tail, exact_old in sources]
        kept_states = [gather_states(s, source.clamp(min=0)) for s in states]
        extra = most - in_tail
        self.tail_keys, self.tail_values = (owned(s[:, :, extra:]) for s in kept_states)
        if extra:
            self.exact_keys, self.exact_values = (owned(s[:, :, :extra]) for s in kept_states)
            self.exact_rows = exact - in_tail
        else:
            self.exact_keys = self.exact_values = self.exact_rows = None

    def rotate_tail_keys(self, delta: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """Re-rotate the tail's keys by `delta` [B, H_kv, t] positions (StreamingLLM, rerotation.py)."""
        assert self.tail_keys is not None and self.tail_values is not None  # appended at the layer's first step
        self.tail_keys = rerotate(self.tail_keys, delta, inv_freq)

    def can_slide(self, kept: int) -> bool:
        """Whether `slide` may drop a slot to keep `kept`: every slot is in the tail and stays there (lossless codecs
        never encode), and the window is at least `KEPT_PER_ROOM_SLOT` slots (a shorter one's gather costs little and
        a room would be a large share of it, as in Gemma-3's tiny test windows)."""
        return self.codec.lossless and self.encoded_keys is None and kept >= KEPT_PER_ROOM_SLOT

    def slide(self, moves: torch.Tensor, sinks: int) -> None:
        """Drop one slot of every row as a window of recent tokens behind `sinks` sink slots drops it on a decode step
        (policies/base.py `recency_drop`): a row where `moves` [B] (bool: no padding) drops the slot after its first
        `sinks`, any other row its first slot (padding, which attention masks whatever it holds). Kept slots keep
        their order.

        The tail is a view of a room (see the class): the window moves one slot up and the sinks follow it, `sinks`
        states per row instead of a copy of every kept slot. Attention reads this step's tail after the eviction
        that calls this, so the move waits for the next read or append (`_settle`), and the slot count drops now
        (`tail_tokens`). A full room (or none yet) is replaced by a fresh one holding the kept slots, with room for
        the next slides (one per `KEPT_PER_ROOM_SLOT` kept slots)."""
        assert self._pending is None  # one slide per step: the append before it made the last
        keys, values = self._tail
        assert keys is not None and values is not None  # appended at the layer's first step
        held = keys.shape[-2]
        assert self.can_slide(held - 1)  # the layer slides only a lossless tail of enough slots
        if self._room is not None and self._room_start + held < self._room[0].shape[-2]:
            self._pending = (moves, sinks)  # the append after the move writes slot room_start + held
            return
        kept = held - 1
        capacity = kept + 1 + kept // KEPT_PER_ROOM_SLOT
        rooms = []
        for old in (keys, values):
            room = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
            room[:, :, :kept] = old[:, :, 1:]
            if sinks:
                room[:, :, :sinks] = torch.where(moves.view(-1, 1, 1, 1), old[:, :, :sinks], room[:, :, :sinks])
            rooms.append(room)
        self._room, self._room_start = (rooms[0], rooms[1]), 0
        self._tail = [rooms[0][:, :, :kept], rooms[1][:, :, :kept]]

    def _settle(self) -> None:
        """Make the pending slide (`slide`): the tail's view moves one slot up, and rows that move their sinks copy
        them one slot up, over the dropped slot."""
        if self._pending is None:
            return
        moves, sinks = self._pending
        self._pending = None
        moved: list[torch.Tensor | None] = []
        for old in self._tail:
            assert old is not None  # a slide is pending on a held tail
            new = old[:, :, 1:]
            if sinks:  # the `where` is computed before the copy: the two ranges overlap
                new[:, :, :sinks] = torch.where(moves.view(-1, 1, 1, 1), old[:, :, :sinks], new[:, :, :sinks])
            moved.append(new)
        self._tail = moved
        self._room_start += 1

    def drop(self, n: int) -> None:
        """Forget the `n` oldest slots, from the encoded store (whole encoded blocks, cut without decoding) and then
        from the tail (a block window, layer.py `_drop_old_blocks`)."""
        from_store = min(n, self.n_encoded)
        if from_store == self.n_encoded:
            self._set_encoded(None, None, 0)
        elif from_store:
            assert self.encoded_keys is not None and self.encoded_values is not None  # n_encoded > from_store > 0
            held = self.n_encoded
            self._set_encoded(_owned_encoded(self.encoded_keys, from_store, held, held),
                              _owned_encoded(self.encoded_values, from_store, held, held), held - from_store,
                              keep_room=True)
        from_held = min(n - from_store, self.n_held)
        if from_held:
            assert self._held is not None  # n_held > 0
            held = self.n_held
            self._set_held(*(None if from_held == held else _owned_encoded(part, from_held, held, held)
                             for part in self._held))
        from_tail = n - from_store - from_held
        if from_tail:
            assert self.tail_keys is not None and self.tail_values is not None  # the slots dropped are held
            self.tail_keys = owned(self.tail_keys[:, :, from_tail:])
            self.tail_values = owned(self.tail_values[:, :, from_tail:])

    def crop(self, keep: int) -> None:
        """Keep the `keep` oldest slots (crop; the caller checked that encoded groups allow it)."""
        assert self.tail_keys is not None and self.tail_values is not None  # appended at the layer's first step
        n_enc, held = self.n_encoded, self.n_held
        if keep < n_enc:
            assert self.encoded_keys is not None and self.encoded_values is not None  # n_encoded > 0
            batch, heads = self.tail_keys.shape[:2]
            index = torch.arange(keep, device=self.tail_keys.device).expand(batch, heads, keep)
            self._set_encoded(gather_encoded(self.encoded_keys, index), gather_encoded(self.encoded_values, index),
                              keep)
        held_keep = min(max(keep - n_enc, 0), held)
        if held_keep < held:
            assert self._held is not None  # held > 0
            self._set_held(*(None if held_keep == 0 else _owned_encoded(part, 0, held_keep, held)
                             for part in self._held))
        tail_keep = max(keep - n_enc - held, 0)
        self.tail_keys = owned(self.tail_keys[:, :, :tail_keep])
        self.tail_values = owned(self.tail_values[:, :, :tail_keep])

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` [B'] (long), in that order (beam search, batch selection)."""
        self._set_encoded(select_batch(self.encoded_keys, indices), select_batch(self.encoded_values, indices),
                          self.n_encoded, keep_room=True)
        if self._held is not None:
            self._set_held(select_batch(self._held[0], indices), select_batch(self._held[1], indices))
        for name in self.TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, indices))

    # -- saving, loading and bytes ----------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}
        for kind, encoded in (("key", self.encoded_keys), ("value", self.encoded_values)):
            for name, tensor in (encoded or {}).items():
                tensors[f"encoded_{kind}.{name}"] = owned(tensor)  # the used slots only, not the room's spare ones
        for kind, held in (("key", self.held_keys), ("value", self.held_values)):
            for name, tensor in (held or {}).items():
                tensors[f"held_{kind}.{name}"] = tensor
        return tensors

    @classmethod
    def from_state(
        cls, codec: Codec, dtype: torch.dtype, tensors: dict[str, torch.Tensor], n_encoded: int, device: torch.device,
        positions: torch.Tensor | None = None,
    ) -> TokenStore:
        """The store `state()` described (other names in `tensors` are ignored), copied to `device`. `positions`
        [B, H_kv, slots]: each slot's key position (the layer's records), for a codec that `needs_positions`."""
        store = cls(codec, dtype)
        for name in cls.TENSORS:
            if name in tensors:
                setattr(store, name, tensors[name].to(device, copy=True))
        encodings = []
        for kind in ("key", "value"):
            prefix = f"encoded_{kind}."
            encoded = {k[len(prefix):]: t.to(device, copy=True) for k, t in tensors.items() if k.startswith(prefix)}
            if encoded:  # saved where the codec stored another form (lowrank's latents: bf16 here, float32 there)
                encoded = codec.as_stored(encoded, kind, dtype)
            if encoded and n_encoded:
                _check_readable(codec, encoded, kind, n_encoded, dtype, positions)
            encodings.append(encoded or None)
        store._set_encoded(encodings[0], encodings[1], n_encoded)
        held: list[Encoded | None] = []
        kinds: tuple[Kind, Kind] = ("key", "value")
        for kind in kinds:  # a file saved before `held` existed holds these tokens in the tail
            prefix = f"held_{kind}."
            part = {k[len(prefix):]: t.to(device, copy=True) for k, t in tensors.items() if k.startswith(prefix)}
            if not part:
                held.append(None)
            elif store.residual_codec is None:
                raise ValueError(f"the saved cache holds reduced residual tokens, which codec {codec.spec()!r} does "
                                 "not hold: build the cache from the document again and save it")
            else:
                held.append(store.residual_codec.as_stored(part, kind, dtype))
        store._set_held(held[0], held[1])
        return store

    def promised_bytes(self, rows: int, head_dim: int, value_dim: int, dtype: torch.dtype | None = None) -> float:
        """Bytes the store should hold for `rows` (batch x KV heads) rows: encoded tokens at the codec's rate, held
        ones at its `residual_codec`'s, the tail at full precision, plus the exact sinks and rows. With `dtype`: had
        the model run in that dtype (keys and values at its width; codes, scales and slot indices keep theirs)."""
        dtype = dtype or self.dtype
        encoded = self.encoded_slots * (  # the rooms are held whole, spare slots too
            self.codec.bytes_per_token(head_dim, "key", dtype) + self.codec.bytes_per_token(value_dim, "value", dtype)
        )
        if self.residual_codec is not None:
            encoded += self.n_held * (self.residual_codec.bytes_per_token(head_dim, "key", dtype)
                                      + self.residual_codec.bytes_per_token(value_dim, "value", dtype))
        element = torch.empty((), dtype=dtype).element_size()
        held = self.tail_tokens if self._room is None else self._room[0].shape[-2]  # a room is held whole
        tail = held * (head_dim + value_dim) * element
        extra = sum(t.numel() * element for t in (self.sink_keys, self.sink_values, self.exact_keys, self.exact_values)
                    if t is not None)
        if self.exact_rows is not None:
            extra += self.exact_rows.numel() * self.exact_rows.element_size()
        if self._pending is not None:  # a pending slide's rows that move their sinks [B] (bool)
            extra += self._pending[0].numel() * self._pending[0].element_size()
        return rows * (encoded + tail) + extra


def _restore_sinks(decoded: torch.Tensor, exact: torch.Tensor, sink_slots: torch.Tensor) -> torch.Tensor:
    """`decoded` [B, H, n, D] with the sink slots it holds replaced by their exact states."""
    n = decoded.shape[-2]
    slots = torch.where((sink_slots >= 0) & (sink_slots < n), sink_slots, n)  # n: a spare slot
    spare = decoded.new_zeros(*decoded.shape[:2], 1, decoded.shape[-1])
    padded = torch.cat([decoded.expand(*slots.shape[:2], n, -1), spare.expand(*slots.shape[:2], 1, -1)], dim=-2)
    padded = padded.scatter(2, slots[..., None].expand(*slots.shape, decoded.shape[-1]), exact.to(decoded.dtype))
    return padded[:, :, :n]


def stored(name: str, empty=None) -> property:
    """A read-only layer attribute for the store's `name` (`empty` before the first step), for code that reads it
    by its name from before `store` (`layer.tail_keys`, `layer.n_encoded`, ...)."""
    return property(lambda layer: empty if layer.store is None else getattr(layer.store, name),
                    doc=f"`store.{name}` (see caches/storage.py).")


def _check_readable(codec: Codec, encoded: Encoded, kind: Kind, tokens: int, dtype: torch.dtype,
                    positions: torch.Tensor | None) -> None:
    """Refuse a saved store that the codec the spec builds now cannot read: decoding its first token block fails
    when the codec's plan for the spec changed since the file was saved (lowrank's ranks per layer, a group size), a
    failure that would otherwise come at the first decode step, deep in attention. Keys of a codec that
    `needs_positions` are decoded at their saved positions, as every later step decodes them."""
    block = min(tokens, max(codec.token_block(kind), 1))
    at = {}
    if kind == "key" and codec.needs_positions:
        if positions is None:
            raise ValueError(f"the saved cache holds no key positions, which codec {codec.spec()!r} decodes its keys "
                             "at: build the cache from the document again and save it")
        at["positions"] = positions[:, :, :block]
    try:
        codec.decode(slice_encoded(encoded, 0, block, tokens), kind, dtype, **at)
    except (RuntimeError, ValueError, IndexError) as error:
        raise ValueError(
            f"the saved cache's {kind}s do not fit the codec {codec.spec()!r} builds for this layer now ({error}): "
            "the file was probably saved by another version of hf-kvcompress, whose plan for this spec differed; "
            "build the cache from the document again and save it"
        ) from error
