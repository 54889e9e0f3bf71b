"""lowrank's copy weights: what each layer's low-rank errors cost the model's copy of a text it has just read.

The attention-output error curves (`calibration.error_curves`) weigh every layer's own error alike, yet on the
suite's development half a quarter's lost answers came back when a few layers (SmolLM2's 18-23) kept exact states,
layers whose own error is no larger than the others'. So each layer is measured end to end: the calibration text's
held-out tokens are read once into a cache where only that layer is stored at `lowrank:ratio=COPY_RATIO` (the error
allocation's ranks, every other layer exact), then read again, and the rise of the model's loss on the second
reading over an exact cache's is the layer's cost (KVzip's reconstruction task, arXiv:2505.23416, as a measure of
what the cache still holds; no question is asked). A layer's weight is 1 plus its cost over the mean cost (negative
rises count as 0), divided by the mean weight: every layer keeps its own curve and the costly ones count more.
lowrank's `allocate=copy` multiplies each layer's curves by it (codecs/lowrank.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .caches.layer import CompressedLayer
from .calibration import JOINT, has_error_curves
from .codecs.identity import IdentityCodec
from .hf.compat import text_config
from .registry import make_cache

COPY_RATIO = 0.25  # the share of dimensions the weights are measured at (the quarter, what they were made for)
COPY_TOKENS = 1024  # tokens read twice per layer: the cost is one prefill of 2 x COPY_TOKENS per layer


@torch.inference_mode()
def copy_loss(model, input_ids: torch.Tensor, cache) -> float:
    """The mean next-token loss over a second reading of `input_ids` [1, T], after the first went into `cache`."""
    model(input_ids=input_ids, cache=cache)
    logits = model(input_ids=input_ids, cache=cache).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, input_ids[0, 1:]))


def copy_costs(model, input_ids: torch.Tensor, spec: str, progress=None) -> tuple[float, list[float]]:
    """(the copy loss with every layer exact, each layer's rise over it with only that layer stored as `spec`)."""
    exact = copy_loss(model, input_ids, DynamicCache())
    costs = []
    for layer_idx in range(text_config(model.config).num_hidden_layers):
        cache = make_cache(spec, model.config)
        for other, layer in enumerate(cache.layers):
            if other != layer_idx:  # the same layer kind (sliding window included), stored exactly
                cache.layers[other] = CompressedLayer(layer.policy, IdentityCodec(), layer.is_sliding,
                                                      attention_window=layer.attention_window)
        costs.append(copy_loss(model, input_ids, cache) - exact)
        if progress is not None:
            progress(f"layer {layer_idx}: copy loss +{costs[-1]:.4f}")
    return exact, costs


def boost_weights(costs: list[float]) -> list[float]:
    """1 plus each cost over the mean cost (negative costs count as 0), divided by the mean weight."""
    positive = [max(cost, 0.0) for cost in costs]
    mean = sum(positive) / len(positive)
    weights = [1 + cost / mean if mean > 0 else 1.0 for cost in positive]
    return [w * len(weights) / sum(weights) for w in weights]


def add_copy_weights(model, input_ids: torch.Tensor, bases: str | None, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str], progress=None) -> list[float]:
    """Measure the copy costs of the bases at `bases` (a directory or file, None: the shipped ones; `tensors` and
    `metadata` loaded from it) on `input_ids` and add `layers.i.copy_weight` (`boost_weights`) to `tensors`;
    returns the costs."""
    if metadata.get("heads") != JOINT or not has_error_curves(tensors):
        raise ValueError("copy weights scale the error curves of joint bases: calibrate them first (hf-kvcompress "
                         "calibrate, or --attention-errors for bases without curves)")
    spec = f"lowrank:ratio={COPY_RATIO},allocate=error" + ("" if bases is None else f",bases={bases}")
    _, costs = copy_costs(model, input_ids, spec, progress)
    for layer_idx, weight in enumerate(boost_weights(costs)):
        tensors[f"layers.{layer_idx}.copy_weight"] = torch.tensor(weight, dtype=torch.float32)
    metadata.update(copy_ratio=str(COPY_RATIO), copy_tokens=str(input_ids.shape[1]))
    return costs
