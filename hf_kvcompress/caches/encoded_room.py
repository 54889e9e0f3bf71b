"""One kind's encoded store (keys or values) held in buffers with spare token slots (`EncodedRoom`).

Joining each decode step's newly encoded tokens to the store with `torch.cat` copies the whole store, per layer and
step: as much memory traffic as attention's own read of it. A room writes them in place instead and is copied only
when it is full, into one with a bounded share of spare slots.
"""

from __future__ import annotations

import torch

from ..codecs.base import Encoded, slice_encoded

# A grown room holds one spare token slot per this many of its tokens (at least one, the whole rounded up to codec
# token blocks): the spare slots cost at most that share of the store's bytes (1/32: ~3%, docs/speed.md, "The
# encoded store grows in place"), also for an eviction's small budget, and a room is copied once per that share of
# appended tokens, so a step pays a 32nd of a token's copy per stored token on average, at any length.
TOKENS_PER_SPARE = 32


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte float (float8) as its raw bytes: copies between slices of them then need no float8 kernels (CPU
    builds lack many, codecs/base.py `index_op`); any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.is_floating_point() and tensor.element_size() == 1 else tensor


class EncodedRoom:
    """An encoding of `tokens` tokens (a codec's dict of tensors whose axis 2 runs over tokens or over groups of
    `token_block` tokens, codecs/base.py) in buffers of `capacity` token slots, `capacity - tokens` of them spare.

    `encoded` is a view of the first `tokens` slots (the buffers themselves when there are no spare ones). `append`
    writes new tokens into the spare slots; a full room is replaced by a larger one (`grown_capacity`). A store
    replaced as a whole starts without spare slots (`EncodedRoom(encoded, tokens)`), or with `capacity` slots: an
    eviction keeps the room's size, so a cache that evicts and grows in turn holds the same bytes throughout."""

    def __init__(self, encoded: Encoded, tokens: int, capacity: int | None = None):
        if tokens <= 0:
            raise ValueError(f"tokens must be > 0 (an empty store holds no room), got {tokens}")
        for name, tensor in encoded.items():
            if tensor.dim() < 3 or tensor.shape[2] == 0 or tokens % tensor.shape[2]:
                raise ValueError(f"encoding {name!r} of shape {list(tensor.shape)} does not hold {tokens} tokens "
                                 "on axis 2")
        self._buffers = encoded
        self.tokens = tokens
        self.capacity = tokens
        self.encoded = encoded
        # A capacity that some tensor cannot hold in whole entries (a per-group one) keeps the exact size instead.
        if capacity is not None and capacity > tokens and all(
                capacity % self._per_entry(name) == 0 for name in encoded):
            self._grow(capacity)
            self.encoded = slice_encoded(self._buffers, 0, tokens, capacity)

    def _per_entry(self, name: str) -> int:
        """Tokens per entry of `name`'s axis 2: 1, or a codec token block (per-channel groups' scales)."""
        return self.capacity // self._buffers[name].shape[2]

    def append(self, new: Encoded, tokens: int, block: int) -> None:
        """Write `new`, an encoding of `tokens` tokens (a whole number of `block`s), after the held ones."""
        needed = self.tokens + tokens
        if needed > self.capacity:
            self._grow(grown_capacity(needed, block))
        for name, buffer in self._buffers.items():
            per_entry = self._per_entry(name)
            start, end = self.tokens // per_entry, needed // per_entry
            _bytes(buffer)[:, :, start:end] = _bytes(new[name])
        self.tokens = needed
        self.encoded = slice_encoded(self._buffers, 0, needed, self.capacity)

    def _grow(self, capacity: int) -> None:
        """Move the held tokens into fresh buffers of `capacity` slots (the old ones are freed)."""
        grown = {}
        for name, buffer in self._buffers.items():
            per_entry = self._per_entry(name)
            fresh = buffer.new_empty(*buffer.shape[:2], capacity // per_entry, *buffer.shape[3:])
            held = self.tokens // per_entry
            _bytes(fresh)[:, :, :held] = _bytes(buffer[:, :, :held])
            grown[name] = fresh
        self._buffers, self.capacity = grown, capacity

    def nbytes(self) -> int:
        """Bytes of the buffers, spare slots included: what the room holds in memory."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


def grown_capacity(needed: int, block: int) -> int:
    """Token slots of a room that must hold `needed` tokens: spare ones beyond (see `TOKENS_PER_SPARE`), the whole a
    multiple of the codec's token `block` so every per-group tensor has whole entries."""
    spare = max(1, needed // TOKENS_PER_SPARE)
    return -(-(needed + spare) // block) * block
