"""shared_heads:ratio on calibrated maps: the maps are plain least squares (keys before RoPE), the cheapest heads are
predicted first, the kept heads are stored as received, bytes are exact, bad input is refused."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.calibration import (
    calibrate_sharing,
    layer_states,
    least_squares,
    load_sharing,
    rope_frequencies,
    save_sharing,
    sharing_levels,
)
from hf_kvcompress.codecs.shared_heads import SharedHeadsCodec, allocate_levels, has_copy_costs
from hf_kvcompress.generation import generate
from hf_kvcompress.ops.rerotate import rerotate

from ..caches.tiny_models import calibration_model, left_padded_prompts, tiny_model

IDS = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(tiny llama with 2 KV heads, its maps' directory)."""
    model = calibration_model("llama")
    tensors, metadata, report = calibrate_sharing(model, IDS, text="random ids")
    assert len(report) == 2 and len(report[0]["key"]) == 1  # 2 heads: one level per layer and kind
    return model, save_sharing(tensors, metadata, tmp_path_factory.mktemp("sharing")).parent


def test_least_squares_is_the_plain_affine_fit():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 6, generator=g), torch.randn(4, 6, generator=g)
    y = x @ w.T + 0.1 * torch.randn(300, 4, generator=g) + 3.0
    weights, bias, residual = least_squares(y, x)
    ones = torch.cat([x, torch.ones(300, 1)], 1).double()
    reference = torch.linalg.lstsq(ones, y.double()).solution  # [7, 4]
    assert torch.allclose(weights, reference[:6].T, atol=1e-6) and torch.allclose(bias, reference[6], atol=1e-6)
    assert torch.allclose(residual, ((ones @ reference - y.double()) ** 2).mean(0), atol=1e-8)


def test_levels_nest_and_predict_the_predictable_head_first():
    g = torch.Generator().manual_seed(2)
    base, other = torch.randn(500, 8, generator=g), torch.randn(500, 8, generator=g)
    mix = torch.randn(8, 8, generator=g)
    copy = base @ mix.T + 0.01 * torch.randn(500, 8, generator=g)  # head 2: a linear map of head 0
    levels = sharing_levels(torch.stack([base, other, copy]))
    assert levels[0]["predicted"].tolist() in ([2], [0]) and levels[0]["cost"] < 1e-3
    assert levels[1]["cost"] > 50 * levels[0]["cost"]  # the independent head cannot be predicted
    assert set(levels[1]["kept"].tolist()) <= set(levels[0]["kept"].tolist())  # nested
    assert levels[1]["map"].shape == (2, 8, 8) and levels[0]["map"].shape == (1, 8, 16)


def test_allocation_takes_the_cheapest_level_first_and_keeps_the_ratio():
    costs = [([0.5, 0.9], [0.01, 0.05]), ([0.02, 0.9], [0.6, 0.95])]  # 2 layers, (key, value) costs at levels 1, 2
    assert allocate_levels(costs, ratio=1.0, heads=3) == [(0, 0), (0, 0)]
    assert allocate_levels(costs, ratio=10 / 12, heads=3) == [(0, 1), (1, 0)]  # 2 of 12 heads: the two cheapest
    assert allocate_levels(costs, ratio=9 / 12, heads=3) == [(0, 2), (1, 0)]  # then the value's second (+0.04)
    assert allocate_levels(costs, ratio=4 / 12, heads=3) == [(2, 2), (2, 2)]  # every layer and kind keeps one head


def test_decoded_states_are_the_least_squares_prediction(fitted):
    model, maps = fitted
    cache = make_cache(f"shared_heads:ratio=0.5,maps={maps}", model.config)
    tensors, _ = load_sharing(maps, model.config)
    states = layer_states(model, IDS)
    inv_freq = torch.tensor(rope_frequencies(model.config)[1])
    codec = cache.layers[1].codec
    assert codec.levels() == ((1, 1), (1, 1))  # 2 x 2 x 2 heads, half stored: one per layer and kind
    for kind, x in zip(("key", "value"), states[1], strict=True):
        x = x[None]  # [1, 2, 200, 32], keys post-RoPE as the cache receives them
        positions = torch.arange(200, dtype=torch.int32).expand(1, 2, -1)
        keep = int(tensors[f"layers.1.{kind}.1.kept"][0])
        drop = 1 - keep
        plain = rerotate(x, -positions, inv_freq) if kind == "key" else x
        ones = torch.cat([plain[0, keep], torch.ones(200, 1)], 1).double()
        fit = torch.linalg.lstsq(ones, plain[0, drop].double()).solution  # the plain reference, on the same states
        expected = (ones @ fit).float()[None, None]
        if kind == "key":
            expected = rerotate(expected, positions[:, :1], inv_freq)
        extra = {"positions": positions} if kind == "key" else {}
        encoded = codec.encode(x, kind, **extra)
        assert encoded["states"].shape == (1, 1, 200, 32)  # one stored head of two
        decoded = codec.decode(encoded, kind, torch.float32, **extra)
        assert torch.equal(decoded[0, keep], x[0, keep])  # the kept head is stored as received
        scale = x[0, drop].abs().max()
        assert (decoded[0, drop] - expected[0, 0]).abs().max() < 2e-3 * scale  # the maps are kept in float16
        mean = x[0].mean(0)  # what the group mean gives the predicted head
        assert (decoded[0, drop] - x[0, drop]).norm() < (mean - x[0, drop]).norm()


def test_ratio_one_stores_every_head_and_equals_dynamic_cache(fitted):
    model, maps = fitted
    cache = make_cache(f"shared_heads:ratio=1.0,maps={maps}", model.config)
    ids = IDS[:, :41]
    with torch.no_grad():
        dynamic = DynamicCache()
        ref = [model(input_ids=ids[:, :40], cache=dynamic).logits, model(input_ids=ids[:, 40:], cache=dynamic).logits]
        out = [model(input_ids=ids[:, :40], cache=cache).logits, model(input_ids=ids[:, 40:], cache=cache).logits]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref, strict=True))
    assert cache.layers[0].n_encoded > 0  # the decode step read the encoded store
    assert all(layer.codec.heads_per_store == 1 for layer in cache.layers)


@pytest.mark.parametrize("spec", ["shared_heads:ratio=0.5",
                                  "shared_heads:ratio=0.75+int4:group_size=16,residual_length=2",
                                  "h2o:budget=8,recent=2+shared_heads:ratio=0.5"])
def test_bytes_are_exact_and_padded_rows_match_rows_alone(fitted, spec):
    model, maps = fitted
    spec = spec.replace("ratio=", f"maps={maps},ratio=")
    rows, ids, mask = left_padded_prompts(seed=3, lengths=(5, 13))
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    stored = 0
    for layer in cache.layers:
        for kind, encoded in (("key", layer.encoded_keys), ("value", layer.encoded_values)):
            held = sum(t.numel() * t.element_size() for t in encoded.values())
            assert held == 2 * layer.n_encoded * layer.codec.bytes_per_token(32, kind, torch.float32) * 2
            stored += held
    assert stored > 0
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0])


def test_bad_input_names_the_parameter(fitted, tmp_path):
    model, maps = fitted
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="ratio"):
            SharedHeadsCodec(ratio=bad)
    with pytest.raises(ValueError, match="not both"):
        SharedHeadsCodec(ratio=0.5, heads_per_group=2)
    with pytest.raises(ValueError, match="maps are read with ratio"):
        SharedHeadsCodec(maps=str(maps))
    with pytest.raises(ValueError, match="sink_tokens"):
        SharedHeadsCodec(ratio=0.5, sink_tokens=-1)
    with pytest.raises(ValueError, match=r"ratio must be at least 1 / KV heads = 0\.500"):
        make_cache(f"shared_heads:ratio=0.3,maps={maps}", model.config)
    with pytest.raises(FileNotFoundError, match="maps="):
        make_cache(f"shared_heads:ratio=0.5,maps={tmp_path}", model.config)
    with pytest.raises(ValueError, match="no packaged head-sharing maps"):
        make_cache("shared_heads:ratio=0.5", model.config)
    other = tiny_model("qwen2").config
    other._name_or_path = "tiny-qwen2"
    with pytest.raises(ValueError, match="model='tiny-llama'"):
        make_cache(f"shared_heads:ratio=0.5,maps={maps}", other)
    with pytest.raises(ValueError, match="at least two KV heads"):
        calibrate_sharing(calibration_model("mistral"), IDS[:, :20])
    assert SharedHeadsCodec(ratio=0.5).sink_tokens == 4 and SharedHeadsCodec().sink_tokens == 0


def test_packaged_smollm2_maps_load_and_store_two_thirds_of_the_heads():
    from hf_kvcompress.models import load_config

    config = load_config("smollm2-135m")
    cache = make_cache("shared_heads:ratio=0.67", config)  # no maps=: the ones shipped for the model
    kept = sum(layer.codec.bytes_per_token(64, kind, torch.bfloat16) for layer in cache.layers
               for kind in ("key", "value"))
    # round(0.67 x 180) = 121 of the 30 layers x 2 kinds x 3 heads stored: bf16 bytes per token and KV head
    assert kept == pytest.approx(121 * 64 * 2 / 3)
    levels = cache.layers[0].codec.levels()
    assert len(levels) == 30 and sum(sum(pair) for pair in levels) == 59
    tensors, _ = load_sharing(None, config)
    assert has_copy_costs(tensors)  # the shipped maps spend a ratio by copy costs (allocate=copy)
    assert make_cache("shared_heads:ratio=0.67,allocate=copy", config).layers[0].codec.levels() == levels


def test_maps_move_to_the_states_device_once(fitted):
    """A layer's maps belong to its cache: read on another device they move there once (the meta device stands in
    for a GPU), so the decode step does not copy them from the host per layer and step."""
    model, maps = fitted
    codec = make_cache(f"shared_heads:ratio=0.5,maps={maps}", model.config).layers[1].codec
    states = torch.randn(1, 2, 5, 32, device="meta")
    assert codec.expand(codec.reduce(states, "value"), "value", torch.float32).device.type == "meta"
    layer = codec._layer
    moved = layer.value
    assert moved is not None and all(t.device.type == "meta" for t in moved)
    codec.reduce(states, "value")
    assert layer.value is moved
