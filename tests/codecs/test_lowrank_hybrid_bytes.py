"""lowrank on a model with sliding-window layers: a ratio is a share of the latents' bytes at `length` (each layer's
dimensions counted at the tokens they are stored for), the cache holds what it promises, and bad input is refused."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.calibration import save_bases
from hf_kvcompress.codecs.lowrank import LowRankCodec, allocate_ranks, allocate_ranks_by_error, layer_costs

from .lowrank_tiny import fit_with_errors

WIDTH = 32  # the tiny Gemma-3: one KV head of 32 dimensions, layers sliding, sliding, full; window 6 (5 tokens held)
LENGTH = 45


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(model, joint bases dir with error curves) for the tiny Gemma-3."""
    g = torch.Generator().manual_seed(0)
    model, tensors, metadata, _, _ = fit_with_errors("gemma3", g)
    return model, save_bases(tensors, metadata, tmp_path_factory.mktemp("bases")).parent


def _share_of_bytes(ranks, costs) -> float:
    """The latents' bytes at the costs' length over the same tokens stored with every dimension."""
    return sum((key + value) * cost for (key, value), cost in zip(ranks, costs, strict=True)) / (2 * WIDTH * sum(costs))


def test_layer_costs_are_the_tokens_each_layer_stores():
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    # A sliding layer holds window - 1 tokens; both kinds keep `exact` of them out of the latents.
    assert layer_costs(types, 512, 2000, 0) == (511 / 2000, 1.0, 511 / 2000)
    assert layer_costs(types, 512, 2000, 132) == (379 / 1868, 1.0, 379 / 1868)
    assert layer_costs(types, 512, 300, 0) == (1.0, 1.0, 1.0)  # shorter than the window: every layer alike
    assert layer_costs(["full_attention"] * 3, 512, 2000, 0) is None


def test_costs_move_dimensions_to_cheap_layers_and_keep_the_bytes():
    falls = [1.0 / (1 + i) for i in range(9)]  # error at ranks 0, 8, ..., 64 (width 64)
    curves = [(falls, falls), (falls, falls)]
    plain = allocate_ranks_by_error(curves, 0.5, 8, 64, 64)
    assert plain == [(32, 32), (32, 32)]
    assert allocate_ranks_by_error(curves, 0.5, 8, 64, 64, costs=(1.0, 1.0)) == plain  # unit costs: as before
    costs = (1.0, 0.25)
    weighted = allocate_ranks_by_error(curves, 0.5, 8, 64, 64, costs=costs)
    assert weighted[1][0] > weighted[0][0]  # the same error falls per dimension: the cheap layer's cost less
    budget = 0.5 * 2 * 64 * sum(costs)
    spent = sum((k + v) * c for (k, v), c in zip(weighted, costs, strict=True))
    assert budget - 8 * max(costs) < spent <= budget  # spent up to less than one step of any layer
    variances = [(torch.linspace(2, 1, 64), torch.linspace(2, 1, 64))] * 2
    by_variance = allocate_ranks(variances, 0.5, 8, 64, costs=costs)
    spent = sum((k + v) * c for (k, v), c in zip(by_variance, costs, strict=True))
    assert by_variance[1][0] > by_variance[0][0] and budget - 8 * max(costs) < spent <= budget
    assert allocate_ranks(variances, 0.5, 8, 64, costs=(1.0, 1.0)) == allocate_ranks(variances, 0.5, 8, 64)


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5,allocate=error,floor=none",
                                  "lowrank:ratio=0.5,allocate=variance,floor=none",
                                  "lowrank:ratio=0.5,allocate=error",
                                  "lowrank:ratio=0.75,allocate=error"])
def test_a_ratio_is_that_share_of_the_bytes_at_length(hybrid, spec):
    """The reference: the same tokens held by the same layers with every dimension (transformers' cache), measured."""
    model, bases = hybrid
    # compute=float32: latents at the float32 model's own width, as the plain cache's keys and values (where the
    # step computes in bf16 a float32 model stores them in bf16, half these bytes: test_lowrank_joint.py)
    spec = f"{spec},bases={bases},length={LENGTH},sink_tokens=0,residual_length=0,compute=float32"
    cache = make_cache(spec, model.config)
    ranks = [layer.codec._ranks[i] for i, layer in enumerate(cache.layers)]
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=ids, cache=cache)
        plain = DynamicCache(config=model.config)  # transformers' own: sliding layers hold window - 1 tokens
        model(input_ids=ids, cache=plain)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()  # bytes exact
    ratio = float(spec.split("ratio=")[1].split(",")[0])
    costs = layer_costs(["sliding_attention"] * 2 + ["full_attention"], 6, LENGTH, 0)
    assert costs is not None
    # The latents' bytes over the plain cache's keys and values (each layer's slot positions, which lowrank's
    # layers keep beside, are no dimension).
    held = sum(t.numel() * t.element_size() for layer in plain.layers for t in (layer.keys, layer.values))
    share = _latents(cache) / held
    step_share = 8 * max(costs) / (2 * WIDTH * sum(costs))  # one step of the dearest layer
    assert ratio - step_share < share <= ratio + 1e-9, ranks
    assert share == pytest.approx(_share_of_bytes(ranks, costs))


def _latents(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for encoded in (layer.encoded_keys, layer.encoded_values) for t in encoded.values())


def test_length_is_checked():
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="length must be a positive integer"):
            LowRankCodec(ratio=0.5, length=bad)
