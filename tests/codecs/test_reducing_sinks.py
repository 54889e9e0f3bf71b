"""Reducing codecs keep their storage codec's full-precision sinks: `shared_heads+int4` and `lowrank+int4` keep the
first 4 real tokens of each row exactly, as plain `int4` does, and the bytes count them unreduced."""

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, parse_spec, use_kvcompress_attention
from hf_kvcompress.caches.head_store import HeadStore
from hf_kvcompress.calibration import calibrate, save_bases
from hf_kvcompress.generation import generate, prefill

from ..caches.test_sinks import _forward, _padded_prompts
from ..caches.tiny_models import tiny_model

STORAGE = "int4:residual_length=0,group_size=8,key_axis=token"  # plain int4: 4 sinks; everything encoded


@pytest.fixture(scope="module")
def llama():
    model = use_kvcompress_attention(tiny_model("llama"))  # 2 layers, 2 KV heads, head_dim 32; H2O, KVzip
    model.config._name_or_path = "tiny-llama"
    return model


@pytest.fixture(scope="module")
def lowrank(llama, tmp_path_factory):
    """`lowrank:...` on bases fitted here (no bases ship for the tiny model), without sinks of its own: the sinks
    here are the storage's (lowrank's own: tests/codecs/test_lowrank_sinks.py)."""
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate(llama, ids, max_rank=16, text="random ids")
    bases = save_bases(tensors, metadata, tmp_path_factory.mktemp("bases")).parent
    return f"lowrank:rank=16,sink_tokens=0,bases={bases}"


@pytest.fixture(params=["shared_heads", "lowrank"])
def reduction(request, lowrank):
    return "shared_heads" if request.param == "shared_heads" else lowrank


def test_the_sink_count_is_the_storages():
    # exact_sinks: what the cache keeps exact (shared_heads:ratio= and lowrank have their own field besides)
    for storage in ("int4", "int3", "int2"):
        for reducing in ("shared_heads", "lowrank", "lowrank+shared_heads"):
            assert parse_spec(f"{reducing}+{storage}")[1].exact_sinks == parse_spec(storage)[1].exact_sinks == 4
    assert parse_spec("shared_heads+int4:sink_tokens=2")[1].exact_sinks == 2
    assert parse_spec("shared_heads+int4:sink_tokens=0")[1].exact_sinks == 0
    assert parse_spec("shared_heads+int8")[1].exact_sinks == parse_spec("shared_heads")[1].exact_sinks == 0


def test_the_first_real_tokens_decode_exactly_and_the_rest_do_not(llama, reduction):
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=llama.config)
    cache = make_cache(f"{reduction}+{STORAGE}", llama.config)
    _forward(llama, ids, mask, reference)
    _forward(llama, ids, mask, cache)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.n_encoded == 30
        assert layer.sink_slots[:, 0].tolist() == [[5, 6, 7, 8], [0, 1, 2, 3]]  # padding is no sink
        keys, values = layer._full("key"), layer._full("value")
        for row, first in ((0, 5), (1, 0)):
            sinks = slice(first, first + 4)
            assert torch.equal(keys[row, :, sinks], exact.keys[row, :, sinks])
            assert torch.equal(values[row, :, sinks], exact.values[row, :, sinks])
            for slot in range(first + 4, 30):  # reduced and quantized
                assert not torch.equal(keys[row, :, slot], exact.keys[row, :, slot])
                assert not torch.equal(values[row, :, slot], exact.values[row, :, slot])


def test_without_sinks_the_first_tokens_are_reduced(llama, reduction):
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=llama.config)
    cache = make_cache(f"{reduction}+{STORAGE},sink_tokens=0", llama.config)
    _forward(llama, ids, mask, reference)
    _forward(llama, ids, mask, cache)
    assert cache.layers[1].sink_slots is None
    assert not torch.equal(cache.layers[1]._full("key")[1, :, :4], reference.layers[1].keys[1, :, :4])


def test_sinks_are_stored_unreduced_and_counted(llama, reduction):
    """Each sink holds every KV head's full key and value (not the reduced states), and the bytes say so."""
    ids, mask = _padded_prompts()
    spec = f"{reduction}+int4:residual_length=4,group_size=8,key_axis=token"
    plain, sinks = make_cache(f"{spec},sink_tokens=0", llama.config), make_cache(spec, llama.config)
    generate(llama, ids, mask, plain, max_new_tokens=9)
    generate(llama, ids, mask, sinks, max_new_tokens=9)
    assert measured_kv_bytes(sinks) == sinks.promised_kv_bytes()
    layer = sinks.layers[0]
    assert layer.sink_keys.shape == (2, layer.kv_heads, 4, layer.head_dim)
    rows = layer.batch_size * layer.kv_heads
    extra = rows * 4 * ((layer.head_dim + layer.value_dim) * 4 + 8)  # fp32 keys and values, int64 slot
    assert measured_kv_bytes(sinks) - measured_kv_bytes(plain) == extra * len(sinks.layers)


def test_sinks_follow_an_evicting_policy(llama, reduction):
    """The policy protects its first 4 tokens: after it evicts, the codec's sinks still decode exactly."""
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=llama.config)
    _forward(llama, ids, mask, reference)
    cache = make_cache(f"h2o:budget=12,recent=4,sink_tokens=4+{reduction}+{STORAGE}", llama.config)
    generate(llama, ids, mask, cache, max_new_tokens=3)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.seen == 32 and layer.stored_tokens < 20 and bool((layer.sink_slots >= 0).all())
        for row, first in ((0, 5), (1, 0)):
            slots = layer.sink_slots[row, :, :, None]  # [H, 4, 1], one selection per head
            for kind, states in (("key", exact.keys), ("value", exact.values)):
                kept = layer._full(kind)[row].gather(1, slots.expand(-1, -1, states.shape[-1]))
                assert torch.equal(kept, states[row, :, first:first + 4])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_head_budgets_keep_lowranks_sinks_exact_beside_the_ranked_store(llama, lowrank):
    """KVzip's per-head budgets protect the codec's sinks in the ranking and keep them exact beside the store."""
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    reference = DynamicCache(config=llama.config)
    _forward(llama, ids, torch.ones_like(ids), reference)
    cache = make_cache(f"kvzip:ratio=0.25,budgets=head+{lowrank}+int4:residual_length=2,group_size=16", llama.config)
    prefill(llama, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert isinstance(layer.store, HeadStore) and layer.store.sink_valid.tolist() == [[True] * 4]
        assert torch.equal(layer.sink_keys, exact.keys[:, :, :4])
        assert torch.equal(layer.sink_values, exact.values[:, :, :4])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_gemma_sliding_layers_hold_sinks_as_plain_int4_does():
    """Sliding layers keep the sinks while their window holds them (then forget them), the full layer for good,
    under shared_heads+int4 exactly as under int4."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        intermediate_size=64, vocab_size=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None  # full-length outputs
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    storage = "int4:residual_length=0,group_size=8"
    reference = DynamicCache(config=config)
    _forward(model, ids, torch.ones_like(ids), reference)
    slots = {}
    for spec in (storage, f"shared_heads+{storage}"):
        cache = make_cache(spec, config)
        _forward(model, ids, torch.ones_like(ids), cache)
        for layer, exact in zip(cache.layers, reference.layers, strict=True):
            assert layer.sink_slots[0, 0].tolist() == [0, 1, 2, 3]
            assert torch.equal(layer._full("key")[:, :, :4], exact.keys[:, :, :4])
        cache = make_cache(spec, config)
        # Past the window and the first key group: a block window drops the sinks' group of 8 once all of it is out.
        generate(model, ids, torch.ones_like(ids), cache, max_new_tokens=16)
        slots[spec] = [layer.sink_slots[0, 0].tolist() for layer in cache.layers]
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert slots[f"shared_heads+{storage}"] == slots[storage] == [[-1, -1, -1, -1], [0, 1, 2, 3]]
