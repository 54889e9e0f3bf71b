"""shared_heads' copy costs: what predicting each level of a layer's heads costs the model's copy of a text it has just
read.

The least-squares residual of a level (`calibration.sharing_levels`: the predicted heads' squared error over the
heads' mean square) ranks predicted key heads far below value heads, yet on the suite's multi_needle, four alike
sentences that differ by key and number, a ratio spent by it answered another needle's number: what a predicted head
loses is where attention lands, which the residual does not weigh (docs/results.md, issue 30, session 37). So each
level is measured end to end, as lowrank's copy weights are (copy_weights.py, KVzip's reconstruction task,
arXiv:2505.23416): held-out calibration tokens are read once into a cache where only that layer and kind predicts
that level's heads (every other head stored), then read again, and the rise of the model's loss on the second reading
over an exact cache's is the level's copy cost. Reading a text again asks each position to find its earlier copy, the
addressing that a lookup among alike sentences needs too. `shared_heads:ratio` spends a ratio by these costs when the
maps hold them (`allocate=copy`).
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache

from .caches.compressed import CompressedCache
from .calibration import load_sharing
from .codecs.shared_heads import SharedHeadsCodec, kv_head_count
from .copy_weights import copy_loss
from .hf.compat import text_config
from .policies.base import Policy
from .registry import parse_spec

KINDS = ("key", "value")
# Tokens read twice per level: a SmolLM2 calibration measures 2 x 30 layers x 2 levels, each one prefill of twice this.
COPY_TOKENS = 512


def bound_maps(maps: str | os.PathLike, config) -> tuple[Policy, SharedHeadsCodec]:
    """(keep-all policy, the head-sharing codec of the maps at `maps` bound to the model), for measuring levels."""
    policy, codec = parse_spec(f"shared_heads:ratio=1.0,maps={maps}")
    assert isinstance(codec, SharedHeadsCodec)  # the spec names it
    return policy, codec.reduction_for_model(config)


def single_level(layers: int, layer: int, kind: str, level: int) -> list[tuple[int, int]]:
    """Per-layer (key, value) levels with only `layer`'s `kind` predicting `level` heads."""
    levels = [(0, 0)] * layers
    levels[layer] = (level, 0) if kind == "key" else (0, level)
    return levels


def level_copy_costs(model, input_ids: torch.Tensor, maps: str | os.PathLike,
                     progress=None) -> tuple[float, list[tuple[list[float], list[float]]]]:
    """(the copy loss with every head stored, per layer (key costs, value costs) at levels 1 .. H-1): the rise of the
    copy loss (`copy_weights.copy_loss` on `input_ids` [1, T]) with only that layer and kind predicting that many
    heads by the maps at `maps`."""
    config = model.config
    layers = text_config(config).num_hidden_layers
    heads = kv_head_count(config)
    policy, bound = bound_maps(maps, config)
    exact = copy_loss(model, input_ids, DynamicCache())
    costs: list[tuple[list[float], list[float]]] = []
    for layer in range(layers):
        pair: tuple[list[float], list[float]] = ([], [])
        for k, kind in enumerate(KINDS):
            for level in range(1, heads):
                levels = single_level(layers, layer, kind, level)
                cache = CompressedCache(policy, bound.with_levels(levels), config=config)
                pair[k].append(copy_loss(model, input_ids, cache) - exact)
            if progress is not None:
                progress(f"layer {layer} {kind}s: copy loss " + " / ".join(f"{c:+.4f}" for c in pair[k]))
        costs.append(pair)
    return exact, costs


def add_copy_costs(model, input_ids: torch.Tensor, maps: str | os.PathLike, tensors: dict[str, torch.Tensor],
                   metadata: dict[str, str], progress=None) -> list[tuple[list[float], list[float]]]:
    """Measure the copy costs of the maps at `maps` (`tensors` and `metadata` read from it, `load_sharing`) on
    `input_ids` and add `layers.i.kind.m.copy_cost` to `tensors`; returns the costs."""
    loaded, _ = load_sharing(maps, model.config)
    if any(not torch.equal(loaded[name].float(), tensors[name].float()) for name in loaded if name.endswith(".map")):
        raise ValueError(f"the maps at {maps} are not the ones given: measure the maps that will be saved")
    _, costs = level_copy_costs(model, input_ids, maps, progress)
    for layer, pair in enumerate(costs):
        for kind, kind_costs in zip(KINDS, pair, strict=True):
            for level, cost in enumerate(kind_costs, start=1):
                tensors[f"layers.{layer}.{kind}.{level}.copy_cost"] = torch.tensor(cost, dtype=torch.float32)
    metadata.update(copy_tokens=str(input_ids.shape[1]))
    return costs

