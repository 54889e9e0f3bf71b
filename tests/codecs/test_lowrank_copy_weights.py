"""lowrank's copy weights (`allocate=copy`): each layer's copy cost is the loss a second reading loses with only that
layer projected, the weights scale the error curves the allocation spends by, the quarter's default reads them when
the bases hold them (the shipped ones do), a half stays by variance, and bad input is refused."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.calibration import has_copy_weights, load_bases, save_bases
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.codecs.lowrank import allocate_ranks_by_error
from hf_kvcompress.copy_weights import add_copy_weights, boost_weights, copy_costs, copy_loss
from hf_kvcompress.models import load_config

from .lowrank_tiny import fit_with_errors


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """(model, bases dir without weights, bases dir with them, costs): a 2-layer llama."""
    g = torch.Generator().manual_seed(0)
    model, tensors, metadata, _, _ = fit_with_errors("llama", g)
    plain = save_bases(tensors, metadata, tmp_path_factory.mktemp("plain")).parent
    copy_ids = torch.randint(3, 128, (1, 200), generator=g)  # past the quarter's 128-token window
    costs = add_copy_weights(model, copy_ids, str(plain), tensors, metadata)
    return model, plain, save_bases(tensors, metadata, tmp_path_factory.mktemp("weighted")).parent, costs


def test_boost_weights_count_the_costly_layers_more():
    weights = boost_weights([0.3, 0.0, -0.1, 0.1])  # mean positive cost 0.1: 4, 1, 1, 2 before normalising
    assert weights == pytest.approx([4 / 2, 1 / 2, 1 / 2, 2 / 2])
    assert boost_weights([0.0, -0.2]) == [1.0, 1.0]  # no cost anywhere: every layer alike


def test_a_layers_cost_is_its_copy_loss_rise_alone(weighted):
    model, plain, _, costs = weighted
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    spec = f"lowrank:ratio=0.25,allocate=error,bases={plain}"
    exact, rises = copy_costs(model, ids, spec)
    assert exact == pytest.approx(copy_loss(model, ids, DynamicCache()))
    assert len(rises) == 2 and len(costs) == 2 and all(abs(rise) > 1e-5 for rise in rises)  # the projection tells
    # A layer alone: the same cache with the other layer made exact by hand.
    for layer_idx in range(2):
        cache = make_cache(spec, model.config)
        other = cache.layers[1 - layer_idx]
        cache.layers[1 - layer_idx] = CompressedLayer(other.policy, IdentityCodec())
        assert rises[layer_idx] == pytest.approx(copy_loss(model, ids, cache) - exact)


def test_copy_allocation_scales_the_error_curves(weighted):
    model, _, bases, _ = weighted
    tensors, metadata = load_bases(bases, model.config)
    assert has_copy_weights(tensors) and metadata["copy_ratio"] == "0.25" and metadata["copy_tokens"] == "200"
    weights = [float(tensors[f"layers.{i}.copy_weight"]) for i in range(2)]
    assert sum(weights) == pytest.approx(2.0) and weights[0] != pytest.approx(weights[1])
    curves = [([w * e for e in tensors[f"layers.{i}.key_error"].tolist()],
               [w * e for e in tensors[f"layers.{i}.value_error"].tolist()]) for i, w in enumerate(weights)]
    codec = make_cache(f"lowrank:ratio=0.25,allocate=copy,bases={bases}", model.config).codec
    width = 2 * 32  # KV heads x head_dim
    assert list(codec._ranks) == allocate_ranks_by_error(curves, 0.25, 8, int(metadata["max_rank"]), width)
    # The quarter's default reads the weights; a half stays by variance.
    assert make_cache(f"lowrank:ratio=0.25,bases={bases}", model.config).codec._ranks == codec._ranks
    half = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).codec._ranks
    assert half == make_cache(f"lowrank:ratio=0.5,allocate=variance,bases={bases}", model.config).codec._ranks


def test_copy_allocation_refuses_bases_without_weights(weighted):
    model, plain, _, _ = weighted
    with pytest.raises(ValueError, match="allocate=copy needs bases with copy weights"):
        make_cache(f"lowrank:ratio=0.25,allocate=copy,bases={plain}", model.config)
    default = make_cache(f"lowrank:ratio=0.25,bases={plain}", model.config).codec._ranks
    assert default == make_cache(f"lowrank:ratio=0.25,allocate=error,bases={plain}", model.config).codec._ranks
    with pytest.raises(ValueError, match="allocate must be one of copy, error, variance"):
        make_cache(f"lowrank:ratio=0.25,allocate=weights,bases={plain}", model.config)


def test_smollm2s_shipped_bases_hold_copy_weights_and_the_quarter_reads_them():
    config = load_config("smollm2-135m")
    tensors, metadata = load_bases(None, config)
    assert has_copy_weights(tensors) and metadata["copy_ratio"] == "0.25" and metadata["copy_tokens"] == "1024"
    weights = [float(tensors[f"layers.{i}.copy_weight"]) for i in range(30)]
    assert max(range(30), key=weights.__getitem__) == 18  # the layer that brought a diagnosed answer back
    quarter = make_cache("lowrank:ratio=0.25", config).codec._ranks
    assert quarter == make_cache("lowrank:ratio=0.25,allocate=copy", config).codec._ranks
    assert quarter != make_cache("lowrank:ratio=0.25,allocate=error", config).codec._ranks
    half = make_cache("lowrank:ratio=0.5", config).codec._ranks  # a half: by variance, as before the weights
    assert half == make_cache("lowrank:ratio=0.5,allocate=variance", config).codec._ranks


def test_gemma3s_ratios_read_copy_weights_and_hold_their_share_of_the_bytes():
    """Gemma-3's weights move dimensions to its full-attention layers, which hold 4 times the sliding layers' tokens
    at 2,000; its ratios count each layer's dimensions at those tokens, so the copy allocation is its default at a
    quarter and a half and the latents hold the ratio's share of the bytes at `length` (docs/results.md)."""
    from hf_kvcompress.study import promised_bytes

    config = load_config("gemma-3-270m")
    tensors, _ = load_bases(None, config)
    assert has_copy_weights(tensors)
    weights = [float(tensors[f"layers.{i}.copy_weight"]) for i in range(18)]
    assert sorted(range(18), key=weights.__getitem__)[-2:] == [5, 11]  # two of the three full-attention layers
    for ratio in (0.25, 0.5):
        plain = make_cache(f"lowrank:ratio={ratio}", config).codec._ranks
        assert plain == make_cache(f"lowrank:ratio={ratio},allocate=copy", config).codec._ranks
        assert plain != make_cache(f"lowrank:ratio={ratio},allocate=error", config).codec._ranks
        for length in (2000, 8000):
            # Without sinks and window the cache holds the latents and each slot's int32 position (4 of the 1,024
            # bytes a token costs a layer in bf16): the ratio, less at most one step of a full-attention layer.
            spec = f"lowrank:ratio={ratio},sink_tokens=0,residual_length=0,length={length}"
            share = promised_bytes(spec, config, length, 2) / promised_bytes("dynamic", config, length, 2)
            assert ratio - 0.003 < share < ratio + 4 / 1024 + 1e-6, (ratio, length, share)
