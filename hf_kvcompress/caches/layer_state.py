"""A layer's state as named tensors and numbers, for `save_cache` and `load_cache` (hf_kvcompress/persist.py).

`STATE_TENSORS` are also the per-row tensors that beam search and batch selection reorder (`batch_select_indices`);
the store (storage.py), the per-slot records (slot_records.py), the padding counts (padding.py) and the scorer
(scorers.py: the newest queries, whether a reconstruction pass scored the slots) save, load and reorder themselves,
under the same names as before (files saved before these parts existed still load).
"""

from __future__ import annotations

import torch

from .head_store import HeadStore
from .layer_fields import LayerFields
from .padding import RowPadding
from .storage import TokenStore


class LayerState(LayerFields):
    """CompressedLayer's persistence (a mixin)."""

    STATE_TENSORS = ("budget_shift",)
    STATE_SCALARS = ("seen", "peak_tokens", "batch_size", "kv_heads", "head_dim", "value_dim")
    HEAD_STORE_SCALARS = ("seen", "batch_size", "kv_heads", "head_dim", "value_dim")  # with meta `kind`

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This layer's tensors by name, and the numbers that describe them, for `save_cache`."""
        if self.scorer.awaiting_attention:
            raise RuntimeError("cannot save a cache layer in the middle of a step (it awaits attention statistics)")
        self._flush_finite_check()
        if self.per_head:
            return self._export_head_store()
        # An initialized token layer: persist.py exports only layers that have seen a step.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        tensors = {name: getattr(self, name) for name in self.STATE_TENSORS if getattr(self, name) is not None}
        tensors.update(self.store.state())
        tensors.update(self.slots.state())
        tensors.update(self.padding.state())
        scorer_tensors, scorer_meta = self.scorer.state()
        tensors.update(scorer_tensors)
        meta = {name: getattr(self, name) for name in self.STATE_SCALARS}
        meta.update(scorer_meta)
        meta["n_encoded"] = self.store.n_encoded
        meta.update(dtype=str(self.dtype).removeprefix("torch."), padding_unknown=self.padding.unknown)
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
        """Restore what `export_state` returned, on `device`."""
        self._clear()
        if meta.get("kind") == HeadStore.KIND:
            self._import_head_store(tensors, meta, device)
            return
        for name in self.STATE_SCALARS:
            setattr(self, name, int(meta[name]))
        self.dtype = getattr(torch, meta["dtype"])
        self.device = torch.device(device)
        for name in self.STATE_TENSORS:
            if name in tensors:
                setattr(self, name, tensors[name].to(self.device, copy=True))
        self.scorer.load_state(tensors, meta, self.device)  # `_clear` gave it a fresh state
        self.store = TokenStore.from_state(self.codec, self.dtype, tensors, int(meta["n_encoded"]), self.device)
        self.slots = type(self.slots).from_state(tensors, self.device)  # `_clear` chose the records
        self.padding = RowPadding.from_state(tensors, bool(meta["padding_unknown"]), self.device)
        self.device = self.padding.pads.device  # "cuda" resolves to "cuda:0", as the model's states will say
        self.is_initialized = True

    def _export_head_store(self) -> tuple[dict[str, torch.Tensor], dict]:
        """A head store's layer (KVzip's head budgets): the store's tensors, and meta `kind` that selects it on load
        with the numbers that describe it (the names and meta such layers were always saved with)."""
        assert isinstance(self.store, HeadStore)  # called when `per_head`
        meta = {"kind": self.store.KIND, **{name: getattr(self, name) for name in self.HEAD_STORE_SCALARS}}
        meta["dtype"] = str(self.dtype).removeprefix("torch.")
        return self.store.state(), meta

    def _import_head_store(self, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
        for name in self.HEAD_STORE_SCALARS:
            setattr(self, name, int(meta[name]))
        self.dtype = getattr(torch, meta["dtype"])
        self.store = HeadStore.from_state(self.codec, self.dtype, tensors, torch.device(device))
        self.padding = None  # the store counts each row's real tokens
        self.device = self.store.device  # "cuda" resolves to "cuda:0", as the model's states will say
        self.scorer.scored = True
        self.is_initialized = True
