"""One kind's encoded store (keys or values) held in buffers with spare token slots (`EncodedRoom`).

Joining each decode step's newly encoded tokens to the store with `torch.cat` copies the whole store, per layer and
step: as much memory traffic as attention's own read of it. A room writes them in place instead and is copied only
when it is full, into one with a bounded share of spare slots.
"""

from __future__ import annotations

import torch

from ..codecs.base import Encoded, index_op, slice_encoded

# A grown room holds one spare token slot per this many of its tokens, and at least `MIN_SPARE` (rounded up to whole
# codec token blocks): it is copied once per that many appended tokens, and the spare slots cost at most that share
# of the store's bytes (1/32: ~3%) beyond the short stores the minimum covers (docs/speed.md, "The encoded store's
# room").
TOKENS_PER_SPARE = 32
MIN_SPARE = 64


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as its raw bytes where a copy into a slice needs it (float8 has no CPU copy kernels of its own)."""
    return index_op(tensor, lambda t: t)


class EncodedRoom:
    """An encoding of `tokens` tokens (a codec's dict of tensors whose axis 2 runs over tokens or over groups of
    `token_block` tokens, codecs/base.py) in buffers of `capacity` token slots, `capacity - tokens` of them spare.

    `encoded` is a view of the first `tokens` slots (the buffers themselves when there are no spare ones). `append`
    writes new tokens into the spare slots; a full room is replaced by a larger one (`grown_capacity`). Everything
    that replaces the store builds a room without spare slots (`EncodedRoom(encoded, tokens)`): an eviction or a crop
    keeps no spare slots that the next steps may never use."""

    def __init__(self, encoded: Encoded, tokens: int):
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
    spare = max(MIN_SPARE, needed // TOKENS_PER_SPARE)
    return -(-(needed + spare) // block) * block
