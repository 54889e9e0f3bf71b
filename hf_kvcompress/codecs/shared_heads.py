"""Share KV heads after training: GQA/MQA applied to a trained cache, by group means or by calibrated maps."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ..calibration import load_sharing, rope_frequencies
from ..hf.compat import text_config
from ..ops.rerotate import rerotate
from .base import Encoded, Kind
from .reducing import ReducingCodec

CALIBRATED_SINKS = 4  # exact first tokens with calibrated maps: the sinks are what maps fitted to text predict worst
# `allocate`: which calibrated cost of a level a ratio spends by: "copy", the rise of the model's loss on a second
# reading of held-out text with only that level predicted (sharing_costs.py), or "residual", the predicted heads'
# least-squares residual over the heads' mean square (calibration.sharing_levels).
ALLOCATIONS = ("copy", "residual")
COST_NAMES = {"copy": "copy_cost", "residual": "cost"}


def has_copy_costs(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether head-sharing maps hold each level's copy cost (`layers.i.kind.m.copy_cost`, sharing_costs.py)."""
    return "layers.0.key.1.copy_cost" in tensors


def kv_head_count(config) -> int:
    decoder = text_config(config)
    return getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads


class LayerSharing:
    """One layer's calibrated sharing for keys and values: per kind None (every head stored) or (kept [k],
    predicted [m], map [m, D, k * D], bias [m, D]); each predicted head is map @ (the kept heads side by side) +
    bias, keys with RoPE undone. Shared by every cache of the model like its weights.

    No `__dict__`: `measured_kv_bytes` counts what each user's cache holds, and the maps are per model, not per user.
    """

    __slots__ = ("key", "value")
    key: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    value: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None

    def __init__(self, tensors: dict[str, torch.Tensor], layer_idx: int, levels: tuple[int, int]):
        for kind, level in zip(("key", "value"), levels, strict=True):
            if level == 0:
                setattr(self, kind, None)
                continue
            prefix = f"layers.{layer_idx}.{kind}.{level}."
            setattr(self, kind, (tensors[prefix + "kept"].long(), tensors[prefix + "predicted"].long(),
                                 tensors[prefix + "map"].float(), tensors[prefix + "bias"].float()))

    def on(self, device: torch.device) -> LayerSharing:
        """These maps on `device`, moved there once: a layer's maps belong to one cache (`for_layer`), so the decode
        step reads them without a host-to-device copy per layer and step."""
        for kind in self.__slots__:
            part = getattr(self, kind)
            if part is not None and part[2].device != device:
                setattr(self, kind, tuple(x.to(device) for x in part))
        return self

    def kept_heads(self, kind: Kind, heads: int) -> int:
        part = getattr(self, kind)
        return heads if part is None else int(part[0].numel())


def allocate_levels(costs: list[tuple[list[float], list[float]]], ratio: float, heads: int) -> list[tuple[int, int]]:
    """Per-layer (key level, value level): how many heads each layer and kind predicts instead of storing, so that
    `ratio` of all layers' key and value heads stay stored. `costs[layer][kind][m - 1]`: the calibrated cost of
    predicting m heads. The cheapest next level anywhere goes first (its cost over the level before), one level at
    a time per (layer, kind) since the levels nest."""
    units = len(costs) * 2 * heads
    to_predict = units - round(ratio * units)
    levels = [[0, 0] for _ in costs]
    for _ in range(to_predict):
        best: tuple[float, int, int] | None = None
        for layer, pair in enumerate(costs):
            for k, kind_costs in enumerate(pair):
                level = levels[layer][k]
                if level >= heads - 1:
                    continue
                gain = kind_costs[level] - (kind_costs[level - 1] if level else 0.0)
                if best is None or gain < best[0]:
                    best = (gain, layer, k)
        if best is None:
            break
        levels[best[1]][best[2]] += 1
    return [(key, value) for key, value in levels]


@dataclass(frozen=True)
class SharedHeadsCodec(ReducingCodec):
    """Stores fewer KV heads than the model has, reading the others from the stored ones.

    The lesson's head-sharing family (GQA, arXiv:2305.13245) is trained in; this codec shows what it costs on a
    checkpoint that was not. Two ways:
    - `heads_per_group`: each group of adjacent KV heads stores its mean key and mean value (the representative
      that minimises the squared error of the group's heads, token by token);
    - `ratio`: calibration (`hf-kvcompress calibrate --sharing`) measures, per layer and kind, which heads the
      others predict best by least squares (keys with RoPE undone, so one map serves every position) and fits those
      maps; the codec stores `ratio` of all layers' key and value heads, predicting the heads that cost least
      first. The kept heads are stored as the cache receives them; a predicted key is turned back by its position,
      mapped and turned forward again, so the layer tracks each slot's position (`needs_positions`).
    Evicting policies keep one selection per stored group (scores averaged over it), since it stores one set of
    tokens: per group of `heads_per_group`, or per layer where a layer predicts any head.

    Args:
        heads_per_group: KV heads sharing one stored mean head; None (and no ratio) shares all of a layer's KV
            heads (MQA). Must divide the model's KV-head count; a model with a single KV head has nothing to share.
        ratio: the share of all layers' key and value heads stored, the rest predicted by calibrated maps; at
            least 1 / KV heads (each layer and kind keeps one head).
        maps: with ratio, a directory (or file) written by `hf-kvcompress calibrate --sharing`; None: the maps
            shipped for the model.
        sink_tokens: the first real tokens of each row kept exact beside the store (caches/codec_sinks.py); None:
            4 with ratio, none with group means (a storage with sinks of its own, `+int4`, keeps its own).
        allocate: with ratio, which calibrated cost of each level the ratio spends by (the cheapest first):
            "copy", what predicting that level alone costs the model's loss on a second reading of held-out text
            (`hf-kvcompress calibrate --sharing` measures it; sharing_costs.py), or "residual", the predicted heads'
            least-squares residual; None: "copy" where the maps hold copy costs, else "residual".
        storage: how the stored heads are stored (full precision by default; `shared_heads+int8` quantizes them).
    """

    name: ClassVar[str] = "shared_heads"

    heads_per_group: int | None = None
    ratio: float | None = None
    maps: str | None = None
    allocate: str | None = None
    sink_tokens: int | None = None  # type: ignore[assignment,misc]  # a field here (the base's property reads the storage's)
    # Bound to the model (ratio): the maps, each layer's (key level, value level), the RoPE frequencies, the KV heads.
    _tensors: dict | None = field(default=None, init=False, repr=False, compare=False)
    _levels: tuple[tuple[int, int], ...] | None = field(default=None, init=False, repr=False, compare=False)
    _inv_freqs: tuple[tuple[float, ...], ...] | None = field(default=None, init=False, repr=False, compare=False)
    _kv_heads: int = field(default=1, init=False, repr=False, compare=False)
    _layer: LayerSharing | None = field(default=None, init=False, repr=False, compare=False)
    _layer_idx: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.heads_per_group is not None and (
            isinstance(self.heads_per_group, bool) or not isinstance(self.heads_per_group, int)
            or self.heads_per_group < 2
        ):
            raise ValueError(
                f"heads_per_group must be an integer >= 2 or None (all KV heads), got {self.heads_per_group!r}"
            )
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
                raise ValueError(f"ratio must be a number in (0, 1] (the share of KV heads stored), got {self.ratio!r}")
            if self.heads_per_group is not None:
                raise ValueError("give heads_per_group (group means) or ratio (calibrated maps), not both")
        elif self.maps is not None:
            raise ValueError("maps are read with ratio=: give shared_heads:ratio=R,maps=DIR")
        if self.allocate is not None:
            if self.allocate not in ALLOCATIONS:
                raise ValueError(f"allocate must be one of {', '.join(ALLOCATIONS)}, got {self.allocate!r}")
            if self.ratio is None:
                raise ValueError("allocate spreads a ratio's predicted heads: give shared_heads:ratio=R,allocate=...")
        if self.sink_tokens is None:
            object.__setattr__(self, "sink_tokens", CALIBRATED_SINKS if self.ratio is not None else 0)
        elif isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(
                f"sink_tokens must be an integer >= 0 (the first real tokens kept exact), got {self.sink_tokens!r}"
            )

    @property
    def calibrated(self) -> bool:
        return self.ratio is not None

    @property
    def heads_per_store(self) -> int:  # type: ignore[override]
        if not self.calibrated:
            return self.heads_per_group or 1
        if self._layer is None:
            return self._kv_heads
        return self._kv_heads if self._layer.key is not None or self._layer.value is not None else 1

    @property
    def needs_positions(self) -> bool:  # type: ignore[override]
        return self._layer is not None and self._layer.key is not None

    @property
    def keeps_rope(self) -> bool:  # type: ignore[override]
        # Group means are head vectors turned by RoPE as the model turns them; a calibrated layer's kept heads are
        # stored side by side, one wide vector per token, which no storage can rotate.
        return not self.calibrated

    def reduction_for_model(self, config) -> SharedHeadsCodec:
        """Settle the group for this model's KV heads, or load the calibrated maps and each layer's levels; refuse
        models with one KV head, groups that do not divide, ratios below one head per layer and kind."""
        heads = kv_head_count(config)
        self.check_kv_heads(heads)
        if not self.calibrated:
            return self if self.heads_per_group is not None else replace(self, heads_per_group=heads)
        assert self.ratio is not None  # calibrated
        if self.ratio < 1 / heads:
            raise ValueError(
                f"ratio must be at least 1 / KV heads = {1 / heads:.3f} (each layer and kind keeps one of its "
                f"{heads} heads) and at most 1, got {self.ratio}"
            )
        if self._levels is not None:  # bound already (`with_levels`)
            return self
        tensors, meta = load_sharing(self.maps, config)
        layers = int(meta["layers"])
        allocate = self.allocate or ("copy" if has_copy_costs(tensors) else "residual")
        if allocate == "copy" and not has_copy_costs(tensors):
            raise ValueError("allocate=copy needs maps with copy costs (hf-kvcompress calibrate --sharing writes "
                             "them): give allocate=residual")
        name = COST_NAMES[allocate]
        costs = [tuple([float(tensors[f"layers.{i}.{kind}.{m}.{name}"]) for m in range(1, heads)]
                       for kind in ("key", "value")) for i in range(layers)]
        levels = allocate_levels(costs, self.ratio, heads)  # type: ignore[arg-type]  # pairs of lists, built above
        bound = copy.copy(self)
        for field_name, value in (("_tensors", tensors), ("_levels", tuple(levels)), ("_kv_heads", heads),
                                  ("_inv_freqs", rope_frequencies(config))):
            object.__setattr__(bound, field_name, value)
        return bound

    def with_levels(self, levels: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> SharedHeadsCodec:
        """This codec, bound to the model, predicting `levels` (per layer: key heads, value heads) instead of what
        its ratio allocates; calibration measures one level at a time with it (sharing_costs.py)."""
        if self._levels is None:
            raise ValueError("with_levels needs the codec bound to a model (reduction_for_model(config))")
        if len(levels) != len(self._levels) or any(
            not 0 <= level < self._kv_heads for pair in levels for level in pair
        ):
            raise ValueError(f"levels must hold one (key, value) pair per layer ({len(self._levels)}), each between "
                             f"0 and {self._kv_heads - 1} (one head of a layer and kind is kept), got {levels!r}")
        bound = copy.copy(self)
        object.__setattr__(bound, "_levels", tuple((int(k), int(v)) for k, v in levels))
        return bound

    def check_kv_heads(self, heads: int) -> None:
        if heads == 1:
            raise ValueError(
                "shared_heads does not apply to this model: it has a single KV head (multi-query attention), "
                "so its query heads already share one key and one value"
            )
        if self.heads_per_group is not None and heads % self.heads_per_group:
            allowed = [g for g in range(2, heads + 1) if heads % g == 0]
            raise ValueError(
                f"heads_per_group must divide the model's {heads} KV heads; allowed: {allowed} or None, "
                f"got {self.heads_per_group}"
            )

    def for_layer(self, layer_idx: int) -> SharedHeadsCodec:
        if not self.calibrated:
            return self.with_storage(self.storage.for_layer(layer_idx))  # type: ignore[return-value]  # a copy of self
        if self._tensors is None:
            raise ValueError(
                "shared_heads:ratio needs the model's config to load its maps (make_cache(spec, model.config))"
            )
        assert self._levels is not None  # settled with the maps (`reduction_for_model`)
        bound = copy.copy(self)  # keeps what binding set (init=False fields), as `with_storage` does
        object.__setattr__(bound, "storage", self.storage.for_layer(layer_idx))
        object.__setattr__(bound, "_layer", LayerSharing(self._tensors, layer_idx, self._levels[layer_idx]))
        object.__setattr__(bound, "_layer_idx", layer_idx)
        object.__setattr__(bound, "_tensors", None)
        return bound

    def levels(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (key, value) count of predicted heads (ratio, once bound to the model)."""
        if self._levels is None:
            raise ValueError("shared_heads has levels only with ratio=, bound to a model (make_cache(spec, config))")
        return self._levels

    def _group(self, heads: int) -> int:
        if self.heads_per_group is None:
            raise ValueError(
                "shared_heads without heads_per_group needs the model's config (make_cache(spec, model.config))"
            )
        self.check_kv_heads(heads)
        return self.heads_per_group

    def _sharing(self) -> LayerSharing:
        if self._layer is None:
            raise ValueError("shared_heads:ratio runs per decoder layer: build the cache with config=model.config")
        return self._layer

    # -- encoding ---------------------------------------------------------------------------------------------------

    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor:
        b, h, t, d = states.shape
        if not self.calibrated:
            g = self._group(h)
            return states.reshape(b, h // g, g, t, d).float().mean(2).to(states.dtype)
        sharing = self._sharing().on(states.device)
        if self.heads_per_store == 1:
            return states
        if h != self._kv_heads:
            raise ValueError(f"the maps hold {self._kv_heads} KV heads, the states have {h}")
        part = getattr(sharing, kind)
        kept = states if part is None else states[:, part[0]]
        return kept.permute(0, 2, 1, 3).reshape(b, 1, t, -1)  # [B, 1, T, k * D]: the kept heads side by side

    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        if not self.calibrated:
            return reduced.repeat_interleave(self.heads_per_store, dim=1).to(dtype)
        return self._expand(reduced, kind, dtype, None)

    def _expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype,
                positions: torch.Tensor | None) -> torch.Tensor:
        if self.heads_per_store == 1:
            return reduced.to(dtype)
        part = getattr(self._sharing().on(reduced.device), kind)
        b, _, t, width = reduced.shape
        heads = self._kv_heads
        if part is None:
            return reduced.reshape(b, t, heads, width // heads).permute(0, 2, 1, 3).to(dtype)
        kept, predicted, weights, bias = part
        dim = weights.shape[1]
        flat = reduced[:, 0].float()  # [B, T, k * D]
        if kind == "key":
            if positions is None:
                raise ValueError("shared_heads:ratio predicts keys before RoPE: decode needs positions=")
            heads_kept = kept.numel()
            at = positions[:, :1].expand(b, heads_kept, t)
            turned = flat.reshape(b, t, heads_kept, dim).permute(0, 2, 1, 3)
            flat = rerotate(turned, -at, self._inv_freq()).permute(0, 2, 1, 3).reshape(b, t, -1)
        out = torch.einsum("btk,mdk->bmtd", flat, weights) + bias[None, :, None, :]  # [B, m, T, D]
        if kind == "key":
            assert positions is not None  # checked above
            out = rerotate(out, positions[:, :1].expand(b, predicted.numel(), t), self._inv_freq())
        full = torch.empty(b, heads, t, dim, dtype=torch.float32, device=reduced.device)
        full[:, kept] = reduced[:, 0].float().reshape(b, t, kept.numel(), dim).permute(0, 2, 1, 3)
        full[:, predicted] = out
        return full.to(dtype)

    def _inv_freq(self) -> torch.Tensor:
        # Calibrated and per layer (`for_layer`): both are set.
        assert self._inv_freqs is not None and self._layer_idx is not None
        return torch.tensor(self._inv_freqs[self._layer_idx], dtype=torch.float32)

    def encode(self, states: torch.Tensor, kind: Kind, positions: torch.Tensor | None = None) -> Encoded:
        """`positions` [B, H_kv, T] (calibrated keys): unused here, the kept heads are stored as received."""
        return self.storage.encode(self.reduce(states, kind), kind)

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype, positions: torch.Tensor | None = None):
        """`positions` [B, H_kv, T]: the position each key was rotated to (calibrated layers that predict keys)."""
        if not self.calibrated:
            return self.expand(self.storage.decode(encoded, kind, dtype), kind, dtype)
        return self._expand(self.storage.decode(encoded, kind, torch.float32), kind, dtype, positions)

    def stored_fraction(self, head_dim: int) -> tuple[int, float]:
        if not self.calibrated:
            return head_dim, self.heads_per_store
        if self._layer is None or self.heads_per_store == 1:
            return head_dim, 1
        return self._layer.kept_heads("key", self._kv_heads) * head_dim, self._kv_heads

    def check_head_dim(self, head_dim: int) -> None:
        if self.calibrated and self._layer is not None and self.heads_per_store > 1:
            for kind in ("key", "value"):
                self.storage.check_head_dim(self._layer.kept_heads(kind, self._kv_heads) * head_dim)
            return
        super().check_head_dim(head_dim)

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        if not self.calibrated:
            return super().bytes_per_token(head_dim, kind, dtype)
        if self._layer is None:
            raise ValueError("shared_heads:ratio stores heads per layer: ask the layer's codec (for_layer)")
        if self.heads_per_store == 1:
            return self.storage.bytes_per_token(head_dim, kind, dtype)
        kept = self._layer.kept_heads(kind, self._kv_heads)
        return self.storage.bytes_per_token(kept * head_dim, kind, dtype) / self._kv_heads

