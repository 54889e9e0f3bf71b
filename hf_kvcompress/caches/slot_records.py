"""A layer's per-slot records: every tensor that follows the layer's slots when they move.

A layer's slots are moved by eviction (`take`: the kept slots, in order), by a block window (`drop`: the oldest
slots), by `crop` (the newest go), and by beam search and batch selection (`select_rows`). Each record moves the
same way, so they live here together and move in one call: a new per-slot tensor is one name in `PER_SLOT` (or in
`SLOT_NUMBERS` when it holds slot numbers rather than one entry per slot), and it is moved, reordered, saved,
loaded and counted in bytes with the others.
"""

from __future__ import annotations

import torch

from .storage import owned


class SlotRecords:
    """The per-slot tensors of one layer; each is None until something records it.

    `PER_SLOT`: [B, H_kv, T, ...] tensors with one entry per slot along dim 2 (`accumulated`: the attention each
    slot received, for policies that score by it; `positions`: the position each kept key is rotated to), or
    [B, 1, T, ...] where every KV head holds the same slots (a layer records its positions so until an eviction
    keeps slots per head: `take` widens such a record to the heads it keeps by, `append` to the heads held).
    `SLOT_NUMBERS`: [B, H_kv, S] tensors of slot numbers (-1: none), renumbered when slots move (`sink_slots`: the
    slots of the codec's exact sink tokens, see codec_sinks.py).
    """

    accumulated: torch.Tensor | None
    positions: torch.Tensor | None
    sink_slots: torch.Tensor | None

    PER_SLOT = ("accumulated", "positions")
    SLOT_NUMBERS = ("sink_slots",)
    FIELDS = PER_SLOT + SLOT_NUMBERS

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.FIELDS = cls.PER_SLOT + cls.SLOT_NUMBERS  # a subclass that adds a name moves it too

    def __init__(self, **tensors: torch.Tensor | None):
        unknown = set(tensors) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"unknown per-slot records {sorted(unknown)}; known: {list(self.FIELDS)}")
        for name in self.FIELDS:
            setattr(self, name, tensors.get(name))

    def _present(self, names: tuple[str, ...]):
        for name in names:
            tensor = getattr(self, name)
            if tensor is not None:
                yield name, tensor

    @property
    def empty(self) -> bool:
        """No record is held: slots may move without moving any record."""
        return all(getattr(self, name) is None for name in self.FIELDS)

    def append(self, name: str, fresh: torch.Tensor) -> None:
        """Record `fresh` [B, H_kv, n, ...] for the n slots just added after the others."""
        held = getattr(self, name)
        if held is not None and held.shape[1] != fresh.shape[1]:  # one of them for every head ([B, 1, ...])
            heads = max(held.shape[1], fresh.shape[1])
            held, fresh = (t.expand(t.shape[0], heads, *t.shape[2:]) for t in (held, fresh))
        setattr(self, name, fresh if held is None else torch.cat([held, fresh], dim=2))

    def take(self, kept: torch.Tensor) -> None:
        """Keep the slots `kept` [B, H_kv, K] (ascending), which become slots 0..K-1 (eviction)."""
        for name, tensor in self._present(self.PER_SLOT):
            if tensor.shape[1] != kept.shape[1]:  # one entry for every head: each head keeps its own slots now
                tensor = tensor.expand(tensor.shape[0], kept.shape[1], *tensor.shape[2:])
            index = kept.view(*kept.shape, *(1,) * (tensor.dim() - 3)).expand(*kept.shape, *tensor.shape[3:])
            setattr(self, name, torch.gather(tensor, 2, index))
        for name, slots in self._present(self.SLOT_NUMBERS):
            # A slot's new number is its rank in `kept` (the last match: a padding filler may repeat slot 0 before
            # it, see select_kept); a slot not kept is gone.
            match = kept[..., None, :] == slots[..., :, None]  # [B, H, S, K]
            last = kept.shape[-1] - 1 - match.flip(-1).long().argmax(-1)
            setattr(self, name, torch.where(match.any(-1), last, -1))

    def drop(self, n: int) -> None:
        """Forget the `n` oldest slots (a block window); slot n becomes slot 0."""
        for name, tensor in self._present(self.PER_SLOT):
            setattr(self, name, owned(tensor[:, :, n:]))
        for name, slots in self._present(self.SLOT_NUMBERS):
            setattr(self, name, torch.where(slots >= n, slots - n, -1))

    def crop(self, keep: int) -> None:
        """Keep the `keep` oldest slots only (crop: the newest tokens go)."""
        for name, tensor in self._present(self.PER_SLOT):
            setattr(self, name, owned(tensor[:, :, :keep]))
        for name, slots in self._present(self.SLOT_NUMBERS):
            setattr(self, name, slots.masked_fill(slots >= keep, -1))

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` [B'] (long), in that order (beam search, batch selection)."""
        for name, tensor in self._present(self.FIELDS):
            setattr(self, name, tensor.index_select(0, indices))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times in place (beams or sequences decoded from one prefilled row)."""
        for name, tensor in self._present(self.FIELDS):
            setattr(self, name, tensor.repeat_interleave(repeats, dim=0))

    def state(self) -> dict[str, torch.Tensor]:
        """The records held, by name (what a saved cache stores under these names)."""
        return dict(self._present(self.FIELDS))

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], device: torch.device) -> SlotRecords:
        """The records among `tensors` (other names are ignored), copied to `device`."""
        return cls(**{name: tensors[name].to(device, copy=True) for name in cls.FIELDS if name in tensors})

    def nbytes(self) -> int:
        """Bytes the records hold."""
        return sum(t.numel() * t.element_size() for _, t in self._present(self.FIELDS))


def record(name: str) -> property:
    """A layer attribute that reads and writes the record `name` of its `slots`, for code that reads it by its old
    name (`layer.accumulated`, `layer.positions`, `layer.sink_slots`)."""

    def get(layer):
        return getattr(layer.slots, name)

    def set_(layer, value):
        setattr(layer.slots, name, value)

    return property(get, set_, doc=f"`slots.{name}` (see caches/slot_records.py).")
