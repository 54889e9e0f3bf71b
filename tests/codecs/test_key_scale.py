"""int codecs' key_scale: key channels divided by calibrated scales before per-token groups, multiplied back on read."""

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcompress import make_cache
from hf_kvcompress.calibration import (
    KEY_SCALE_SKIP,
    calibrate_key_scales,
    channel_spread,
    key_scales_file,
    load_key_scales,
    save_key_scales,
)
from hf_kvcompress.codecs.base import resolve_for_model, resolve_for_policy
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.measure import measured_kv_bytes
from hf_kvcompress.models import load_config
from hf_kvcompress.registry import parse_spec

from ..caches.tiny_models import padded_batch_against_rows_alone, tiny_model, write_key_scales

HEADS, DIM = 2, 32


def _config():
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=HEADS, head_dim=DIM,
                       num_hidden_layers=2, intermediate_size=64, vocab_size=64)


def _bound(tmp_path, layer=1, **fields):
    """An int4 codec with per-token keys and the key scales of a 2-layer config, as layer `layer` runs it."""
    config = _config()
    path = write_key_scales(tmp_path, config)
    codec = IntNCodec(bits=4, group_size=8, key_axis="token", key_scale=str(path), **fields)
    return resolve_for_model(codec, config).for_layer(layer), load_key_scales(path, config)[layer]


def _uneven_keys(seed=0, tokens=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, HEADS, tokens, DIM, generator=g) * torch.linspace(0.2, 30.0, DIM)


@pytest.mark.parametrize("rotate", ["none", "hadamard"])
def test_decoded_keys_equal_scale_quantize_per_token_unscale(tmp_path, rotate):
    codec, scale = _bound(tmp_path, rotate=rotate)
    keys = _uneven_keys()
    plain = IntNCodec(bits=4, group_size=8, key_axis="token", rotate=rotate).for_layer(1)  # same signs
    reference = plain.decode(plain.encode(keys / scale[:, None], "key"), "key", torch.float32) * scale[:, None]
    torch.testing.assert_close(codec.decode(codec.encode(keys, "key"), "key", torch.float32), reference)
    # values are never scaled
    torch.testing.assert_close(codec.decode(codec.encode(keys, "value"), "value", torch.float32),
                               plain.decode(plain.encode(keys, "value"), "value", torch.float32))


@pytest.mark.parametrize("rotate", ["none", "hadamard"])
def test_the_scaled_query_meets_the_stored_keys_as_the_plain_query_meets_the_decoded_keys(tmp_path, rotate):
    codec, _ = _bound(tmp_path, rotate=rotate)
    encoded = codec.encode(_uneven_keys(), "key")
    query = torch.randn(2, HEADS, 3, DIM, generator=torch.Generator().manual_seed(1))
    reference = query @ codec.decode(encoded, "key", torch.float32).transpose(-1, -2)
    in_basis = codec.key_query(query) @ codec.decode_in_basis(encoded, "key", torch.float32).transpose(-1, -2)
    torch.testing.assert_close(in_basis, reference, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(codec.key_logits(encoded, codec.key_query(query)), reference, atol=1e-3, rtol=1e-4)
    # to_basis and from_basis stay inverse to each other for keys
    keys = _uneven_keys(seed=2)
    torch.testing.assert_close(codec.from_basis(codec.to_basis(keys, "key"), "key"), keys, atol=2e-3, rtol=1e-5)


def test_scales_matching_the_channels_lower_the_per_token_error(tmp_path):
    """Channels of spreads 0.2 to 30 share one per-token grid, whose step the widest sets: the narrow channels are
    lost in it. Scales equal to the channels' spreads give each channel an error in proportion to its spread."""
    config = _config()
    config._name_or_path = "tiny"
    keys = _uneven_keys(tokens=64)
    scales = channel_spread(keys[0], "absmax")
    tensors = {f"layers.{i}.key_scale": scales.clone() for i in range(2)}
    metadata = {"format": "hf-kvcompress-key-scales-1", "model": "tiny", "layers": "2", "kv_heads": str(HEADS),
                "head_dim": str(DIM), "stat": "absmax", "keys": "post_rope", "tokens": "64", "text": "x"}
    path = save_key_scales(tensors, metadata, tmp_path)
    scaled = resolve_for_model(IntNCodec(bits=4, key_axis="token", key_scale=str(path)), config).for_layer(0)
    plain = IntNCodec(bits=4, key_axis="token")
    # each channel's error relative to its own size, averaged over the channels
    error = {name: ((c.decode(c.encode(keys, "key"), "key", torch.float32) - keys).pow(2).sum((0, 1, 2))
                    / keys.pow(2).sum((0, 1, 2))).sqrt().mean()
             for name, c in (("scaled", scaled), ("plain", plain))}
    assert error["scaled"] < 0.5 * error["plain"], error


def test_per_channel_keys_are_left_as_they_are(tmp_path):
    codec, _ = _bound(tmp_path)
    channel = resolve_for_policy(IntNCodec(bits=4, group_size=8, key_scale=codec.key_scale), evicts=False)
    channel = resolve_for_model(channel, _named(tmp_path)).for_layer(1)
    plain = IntNCodec(bits=4, group_size=8, key_axis="channel").for_layer(1)
    keys = _uneven_keys()
    torch.testing.assert_close(channel.decode(channel.encode(keys, "key"), "key", torch.float32),
                               plain.decode(plain.encode(keys, "key"), "key", torch.float32))


def test_bad_key_scale_names_the_parameter(tmp_path):
    for bad in ("", 3):
        with pytest.raises(ValueError, match="key_scale must be one of"):
            IntNCodec(key_scale=bad)
    config = _config()
    config._name_or_path = "no-such-model"
    with pytest.raises(ValueError, match="key_scale=calibrated"):
        resolve_for_model(IntNCodec(key_scale="calibrated"), config)
    with pytest.raises(FileNotFoundError, match="key_scale="):
        resolve_for_model(IntNCodec(key_scale=str(tmp_path / "missing")), config)
    path = write_key_scales(tmp_path, _config())
    with pytest.raises(ValueError, match="fitted for model='tiny-key-scales'"):
        resolve_for_model(IntNCodec(key_scale=str(path)), config)  # another model's file
    with pytest.raises(ValueError, match="key_scale must be none or auto for a codec stored after another"):
        make_cache(f"sink_window:sink_tokens=2,window=8+shared_heads+int4:key_scale={path}", _named(tmp_path))


def _named(tmp_path):
    config = _config()
    write_key_scales(tmp_path, config)
    return config


def test_auto_scales_gemma_keys_and_no_others(tmp_path):
    """`auto` (the plain names) scales keys where it was measured to help: Gemma-3, which ships scales; SmolLM2 ships
    them too (key_scale=calibrated) but is left unscaled; a model without a name or a file is left unscaled."""
    unnamed = _config()
    assert resolve_for_model(IntNCodec(key_scale="auto"), unnamed).model_key_scales is None
    unnamed._name_or_path = "no-such-model"
    assert key_scales_file(None, unnamed) is None
    assert resolve_for_model(IntNCodec(key_scale="auto"), unnamed).model_key_scales is None
    assert parse_spec("int4")[1].key_scale == "auto" and parse_spec("int8")[1].key_scale == "none"
    assert parse_spec("int2")[1].key_scale == parse_spec("int3")[1].key_scale == "none"  # measured at 4 bits only
    for name, auto in (("gemma-3-270m", True), ("smollm2-135m", False)):
        config = load_config(name)
        layers = config.get_text_config().num_hidden_layers
        bound = resolve_for_model(IntNCodec(key_scale="auto"), config)
        assert (bound.model_key_scales is not None) == auto, name
        codec = resolve_for_model(IntNCodec(key_scale="calibrated"), config)
        calibrated = codec.model_key_scales
        assert calibrated is not None and calibrated.tensor.shape[0] == layers
        assert codec.model_bytes() == calibrated.tensor.numel() * 4
        assert (calibrated.tensor > 0).all()


def test_a_stack_stores_its_reduced_states_unscaled(tmp_path):
    config = _named(tmp_path)
    cache = make_cache("shared_heads+int4:key_scale=auto", config)
    assert all(layer.codec.storage.model_key_scales is None for layer in cache.layers)


def test_calibration_round_trip(tmp_path):
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-llama"
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    tensors, metadata, report = calibrate_key_scales(model, ids, stat="rms")
    from hf_kvcompress.calibration import layer_states

    states = layer_states(model, ids)
    for i, (keys, _) in enumerate(states):
        expected = keys[:, KEY_SCALE_SKIP:].pow(2).mean(1).sqrt()
        torch.testing.assert_close(tensors[f"layers.{i}.key_scale"], expected)
    path = save_key_scales(tensors, metadata, tmp_path)
    assert key_scales_file(tmp_path, model.config) == path
    loaded = load_key_scales(path, model.config)
    torch.testing.assert_close(loaded, torch.stack([tensors[f"layers.{i}.key_scale"] for i in range(len(states))]))
    assert len(report) == len(states)
    with pytest.raises(ValueError, match="stat must be one of"):
        channel_spread(states[0][0], "median")


def test_the_spec_names_key_scale_and_parses_back(tmp_path):
    codec = parse_spec("int4:key_scale=none")[1]
    assert codec.key_scale == "none"
    assert parse_spec(codec.spec())[1].key_scale == codec.key_scale


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_padded_batch_equals_its_rows_alone(tmp_path, name):
    model = tiny_model(name)
    path = write_key_scales(tmp_path, model.config)
    cache = padded_batch_against_rows_alone(model, f"sink_window:sink_tokens=2,window=8+int4:group_size=16,"
                                                   f"residual_length=2,key_scale={path}")
    assert all(layer.codec.layer_key_scale is not None for layer in cache.layers)
    # the scales are the model's, not the cache's: the bytes a cache holds are what it promises
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_scales_move_to_the_states_device_once(tmp_path):
    """A layer's scales belong to its cache: read on another device they move there once (the meta device stands
    in for a GPU), so the decode step does not copy them from the host per layer and step."""
    codec, _ = _bound(tmp_path)
    keys = torch.randn(2, HEADS, 24, DIM, device="meta")
    assert codec.encode(keys, "key")["codes"].device.type == "meta"
    moved = codec.layer_key_scale.tensor
    assert moved.device.type == "meta"
    codec.encode(keys, "key")
    assert codec.layer_key_scale.tensor is moved
