"""Reducing codecs bind their storage codec to the model and to each layer, as the storage codec alone is bound."""

import pytest
import torch
from transformers import Gemma3TextConfig

from hf_kvcompress import make_cache, measured_kv_bytes, parse_spec
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.calibration import calibrate, save_bases
from hf_kvcompress.hf.rope import rope_inv_freq

from ..caches.tiny_models import CONFIGS, tiny_model


def _gemma():
    """Gemma-3 with two KV heads (shared_heads refuses one) and a sliding layer before the full one."""
    return Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=64, intermediate_size=64, vocab_size=64, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def lowrank_bases(tmp_path_factory):
    """Bases fitted on a tiny Llama and a tiny Gemma-3 (no bases ship for either): {family: (config, dir)}."""
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    out = {}
    for family in ("llama", "gemma3"):
        model = tiny_model(family)
        model.config._name_or_path = f"tiny-{family}"
        tensors, metadata, _ = calibrate(model, ids, max_rank=16, text="random ids")
        out[family] = model.config, save_bases(tensors, metadata, tmp_path_factory.mktemp(family)).parent
    return out


def _with_rotation(spec, rotation):
    """`spec` with `rotate=<rotation>` added to its last codec's arguments."""
    return spec + ("," if ":" in spec.rsplit("+", 1)[-1] else ":") + f"rotate={rotation}"


def _check_rotation_settles(spec, config, rotation, x):
    """`spec` (ending in plain int4) stores the full-attention layer's keys and values exactly as the spec with
    `rotate=<rotation>` written out, and its keys unlike the other rotation's (so the test sees a missing binding)."""
    cache = CompressedCache(codec=parse_spec(spec)[1], config=config)
    assert cache.codec.storage.settled_rotation == rotation
    assert cache.codec.storage.spec() == parse_spec(spec)[1].storage.spec()  # what the user asked for: rotate=auto
    full = cache.layers[-1].codec
    explicit, other = (CompressedCache(codec=parse_spec(_with_rotation(spec, r))[1], config=config).layers[-1].codec
                       for r in (rotation, {"per_token": "hadamard", "hadamard": "per_token"}[rotation]))
    for kind in ("key", "value"):
        assert torch.equal(full.encode(x, kind)["codes"], explicit.encode(x, kind)["codes"])
    assert not torch.equal(full.encode(x, "key")["codes"], other.encode(x, "key")["codes"])
    return cache


def test_shared_heads_storage_settles_the_rotation_per_model_family():
    x = torch.randn(1, 2, 64, 32)
    _check_rotation_settles("shared_heads+int4", CONFIGS["llama"](), "hadamard", x)
    on_gemma = _check_rotation_settles("shared_heads+int4", _gemma(), "per_token",
                                       torch.randn(1, 2, 64, 64))
    sliding, full = (layer.codec.storage for layer in on_gemma.layers)
    assert not full._rotates("key") and not sliding._rotates("key") and full._rotates("value")
    assert sliding.key_axis == "channel" and sliding.settled_rotation == "per_token"


def test_lowrank_storage_settles_the_rotation_per_model_family(lowrank_bases):
    for family, rotation in (("llama", "hadamard"), ("gemma3", "per_token")):
        config, bases = lowrank_bases[family]
        spec = f"lowrank:rank=16,bases={bases}+int4:group_size=16"
        kv_heads = config.num_key_value_heads
        cache = _check_rotation_settles(spec, config, rotation, torch.randn(1, kv_heads, 64, 32))
        assert [layer.codec.storage.layer for layer in cache.layers] == list(range(len(cache.layers)))


def test_plain_storage_without_auto_is_left_as_written():
    cache = CompressedCache(codec=parse_spec("shared_heads+int4:rotate=hadamard")[1], config=_gemma())
    assert cache.codec.storage.settled_rotation == "" and cache.layers[1].codec.storage._rotates("key")


def test_evicting_policies_keep_what_binding_settled():
    """for_policy rebuilds the storage (key_axis): the rotation settled by binding must survive it. The evicting
    full-attention layers store keys per token; the sliding layer keeps per-channel keys (block window)."""
    cache = make_cache("h2o:budget=32,recent=8+shared_heads+int4", _gemma())
    expected = ["token"] + ["channel" if layer.is_sliding else "token" for layer in cache.layers]
    storages = [cache.codec.storage] + [layer.codec.storage for layer in cache.layers]
    for storage, axis in zip(storages, expected, strict=True):
        assert storage.key_axis == axis and storage.settled_rotation == "per_token"


def test_shared_heads_storage_reads_the_models_rope_frequencies():
    """The mean of heads at one position is turned by RoPE as each head is: pre_rope (plain int2) applies, with the
    frequencies of the model's head_dim, and a cache that stores keys runs (it needed them and had none)."""
    for config in (CONFIGS["llama"](), _gemma()):
        storage = make_cache("shared_heads+int2", config).codec.storage
        expected = tuple(rope_inv_freq(config, "full_attention").tolist())
        assert storage.inv_freq == expected == make_cache("int2", config).codec.inv_freq
    model = tiny_model("llama")
    cache = make_cache("shared_heads+int2:residual_length=0", model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 64)), cache=cache)
    assert cache.layers[0].n_encoded == 64


def test_lowrank_refuses_pre_rope_storage(lowrank_bases):
    """Coordinates on a PCA basis are no RoPE-turned head vectors: undoing RoPE on them would be meaningless."""
    config, bases = lowrank_bases["llama"]
    with pytest.raises(ValueError, match=r"pre_rope must be false .* lowrank\+int2:.*pre_rope=False"):
        make_cache(f"lowrank:rank=16,bases={bases}+int2:group_size=16", config)
    with pytest.raises(ValueError, match="pre_rope must be false"):  # however deep the storage sits
        make_cache(f"lowrank:rank=16,bases={bases}+shared_heads+int2:group_size=16", config)
    cache = make_cache(f"lowrank:rank=16,bases={bases}+int2:group_size=16,pre_rope=false", config)
    assert cache.codec.storage.settled_rotation == "hadamard" and cache.codec.storage.inv_freq is None


def test_storage_is_bound_to_each_layer():
    """wide_layers of the storage codec hold through a reducing codec (bytes counted at their width), and are
    checked against the model; each layer rotates with its own signs, as plain int4's layers do."""
    model = tiny_model("llama")
    config = model.config
    cache = make_cache("shared_heads+int2:wide_layers=1,residual_length=0", config)
    assert [layer.codec.storage.bits for layer in cache.layers] == [2, 4]
    assert [layer.codec.storage.layer for layer in cache.layers] == [0, 1]
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 64)), cache=cache)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    with pytest.raises(ValueError, match="wide_layers must be decoder layers 0 to 1"):
        make_cache("shared_heads+int2:wide_layers=2", config)


def test_sliding_layers_group_keys_as_the_storage_says_under_a_reducing_codec():
    """Per-channel keys (unset or explicit) hold for the sliding layers too, under a block window, as for plain
    int4; an explicit key_axis='token' keeps keys per token and the exact window."""
    from hf_kvcompress.policies.block_window import BlockWindowPolicy
    from hf_kvcompress.policies.sink_window import SinkWindowPolicy

    for axis in ("", ":key_axis=channel"):
        cache = make_cache(f"shared_heads+int4{axis}", _gemma())
        assert [layer.codec.storage.key_axis for layer in cache.layers] == ["channel", "channel"]
        assert [layer.codec.storage.settled_rotation for layer in cache.layers] == ["per_token", "per_token"]
        assert isinstance(cache.layers[0].policy, BlockWindowPolicy)
    cache = make_cache("shared_heads+int4:key_axis=token", _gemma())
    assert [layer.codec.storage.key_axis for layer in cache.layers] == ["token", "token"]
    assert isinstance(cache.layers[0].policy, SinkWindowPolicy)


def test_storage_needing_the_model_asks_for_the_config():
    with pytest.raises(ValueError, match="config"):
        make_cache("shared_heads:heads_per_group=2+int2")
