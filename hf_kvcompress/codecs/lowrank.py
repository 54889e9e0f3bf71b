"""Low rank: keys and values stored as their coordinates on a per-layer, per-head PCA basis (r < head_dim)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ..calibration import load_bases
from .base import Kind
from .reducing import ReducingCodec


class LayerBases:
    """One layer's means [H, D] and bases [H, D, r], shared by every cache of the model like its weights.

    No `__dict__`: `measured_kv_bytes` counts what each user's cache holds, and these are per model, not per user.
    """

    __slots__ = ("key_mean", "key_basis", "value_mean", "value_basis")

    def __init__(self, tensors: dict[str, torch.Tensor], layer_idx: int, rank: int):
        for kind in ("key", "value"):
            setattr(self, f"{kind}_mean", tensors[f"layers.{layer_idx}.{kind}_mean"].float())
            setattr(self, f"{kind}_basis", tensors[f"layers.{layer_idx}.{kind}_basis"][..., :rank].float().contiguous())


@dataclass(frozen=True)
class LowRankCodec(ReducingCodec):
    """Stores each head's key and value as `rank` coordinates on that head's calibrated PCA basis (Palu,
    arXiv:2407.21118, and Eigen Attention compress the same way; MLA trains it in).

    Keys are projected after RoPE, as the cache receives them: the basis then needs no positions, and on the
    embedded models post-RoPE keys keep nearly as much variance as pre-RoPE ones (see `hf-kvcompress calibrate`).

    Args:
        rank: coordinates stored per head (< head_dim); None: head_dim // 4, the lesson's 128 -> 32.
        bases: a directory (or file) written by `hf-kvcompress calibrate`; None: the bases shipped for the model.
        storage: how the coordinates are stored (`lowrank+int4` quantizes them).
    """

    name: ClassVar[str] = "lowrank"
    keeps_rope: ClassVar[bool] = False  # coordinates on a basis: the storage cannot undo RoPE on them (pre_rope)

    rank: int | None = None
    bases: str | None = None
    _tensors: dict | None = field(default=None, init=False, repr=False, compare=False)
    _layer: LayerBases | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(
                f"rank must be a positive integer below head_dim, or None (head_dim // 4), got {self.rank!r}"
            )

    def reduction_for_model(self, config) -> LowRankCodec:
        """Load and check the bases for this model; settle `rank`."""
        tensors, meta = load_bases(self.bases, config)
        head_dim, max_rank = int(meta["head_dim"]), int(meta["max_rank"])
        rank = self.rank if self.rank is not None else head_dim // 4
        if rank > max_rank:
            raise ValueError(f"rank must be at most {max_rank} (the components these bases hold), got {rank}")
        bound = replace(self, rank=rank)
        object.__setattr__(bound, "_tensors", tensors)
        return bound

    def for_layer(self, layer_idx: int) -> LowRankCodec:
        if self._tensors is None:
            raise ValueError("lowrank needs the model's config to load its bases (make_cache(spec, model.config))")
        assert self.rank is not None  # settled with the bases (`reduction_for_model`)
        # replace() keeps the layer's bases only, not every layer's; the storage is bound to the layer too.
        bound = replace(self, storage=self.storage.for_layer(layer_idx))
        object.__setattr__(bound, "_layer", LayerBases(self._tensors, layer_idx, self.rank))
        return bound

    def _bases(self, kind: Kind, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._layer is None:
            raise ValueError("lowrank runs per decoder layer: build the cache with config=model.config")
        mean, basis = getattr(self._layer, f"{kind}_mean"), getattr(self._layer, f"{kind}_basis")
        if basis.shape[0] != heads:
            raise ValueError(f"the bases hold {basis.shape[0]} KV heads, the states have {heads}")
        return mean, basis

    def check_head_dim(self, head_dim: int) -> None:
        if self.rank is not None and self.rank >= head_dim:
            raise ValueError(f"rank must be below head_dim ({head_dim}), got {self.rank}")
        super().check_head_dim(head_dim)

    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor:
        mean, basis = self._bases(kind, states.shape[1])
        mean, basis = mean.to(states.device), basis.to(states.device)
        centered = states.float() - mean[None, :, None, :]
        return torch.einsum("bhtd,hdr->bhtr", centered, basis).to(states.dtype)

    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        mean, basis = self._bases(kind, reduced.shape[1])
        mean, basis = mean.to(reduced.device), basis.to(reduced.device)
        return (torch.einsum("bhtr,hdr->bhtd", reduced.float(), basis) + mean[None, :, None, :]).to(dtype)

    def stored_fraction(self, head_dim: int) -> tuple[int, int]:
        return (self.rank if self.rank is not None else head_dim // 4), 1
