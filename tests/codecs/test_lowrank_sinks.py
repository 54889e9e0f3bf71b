"""lowrank's own exact sinks (`sink_tokens`, 4 by default): each row's first real tokens bypass the bases and the
storage, decode exactly, follow eviction, are counted in the promised and the measured bytes, and leave a padded row
answering as it does alone; beside a storage with sinks of its own (`+int4`) the stack keeps the most either asks
for."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, parse_spec
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.study import promised_bytes

from ..caches.test_sinks import _forward, _padded_prompts
from ..caches.tiny_models import padded_batch_against_rows_alone
from .lowrank_tiny import llama_with_bases, with_bases

INT4 = "int4:residual_length=0,group_size=8,key_axis=token"  # everything encoded; int4's own 4 sinks


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, joint bases dir): 2 layers, 2 KV heads, head_dim 32; every component kept (ratio=1.0: full rank)."""
    return llama_with_bases(tmp_path_factory)


_spec = with_bases


def test_sink_tokens_default_compose_and_refuse_bad_values():
    assert LowRankCodec().sink_tokens == parse_spec("lowrank")[1].exact_sinks == parse_spec("int4")[1].sink_tokens == 4
    assert parse_spec("lowrank:sink_tokens=0")[1].exact_sinks == 0
    assert parse_spec("lowrank:sink_tokens=2+int8")[1].exact_sinks == 2  # int8 has none
    assert parse_spec("lowrank+int4")[1].exact_sinks == 4
    assert parse_spec("lowrank+int4:sink_tokens=8")[1].exact_sinks == 8  # the most either asks for
    assert parse_spec("lowrank:sink_tokens=0+int4")[1].exact_sinks == 4
    assert parse_spec("lowrank:sink_tokens=0+int4:sink_tokens=0")[1].exact_sinks == 0
    assert parse_spec("lowrank:sink_tokens=6+shared_heads+int4:sink_tokens=0")[1].exact_sinks == 6
    assert parse_spec("lowrank:sink_tokens=0")[1].spec() == "lowrank:sink_tokens=0"  # the spec names a change
    for bad in (-1, 1.5, True, "four"):
        with pytest.raises(ValueError, match="sink_tokens must be an integer >= 0"):
            LowRankCodec(sink_tokens=bad)
    with pytest.raises(ValueError, match="sink_tokens"):
        parse_spec("lowrank:sink_tokens=-2")


@pytest.mark.parametrize("policy", ["", "sink_window:sink_tokens=2,window=1000+"])
def test_full_rank_with_sinks_equals_dynamic_cache(llama, policy):
    model, bases = llama
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 35), generator=g)
    positions = torch.arange(35)[None].expand(2, -1)

    def steps(cache):
        with torch.no_grad():
            outs = [model(input_ids=ids[:, :30], cache=cache, position_ids=positions[:, :30]).logits]
            for j in range(30, 35):  # single-token steps read the encoded store
                outs.append(model(input_ids=ids[:, j:j + 1], cache=cache, position_ids=positions[:, j:j + 1]).logits)
        return torch.cat(outs, 1)

    reference = DynamicCache()
    # compute=float32: full rank equals DynamicCache to float32's rounding (bf16 keys: test_lowrank_attention.py)
    cache = make_cache(_spec(bases, f"{policy}lowrank:ratio=1.0,compute=float32"), model.config)
    delta = (steps(cache) - steps(reference)).abs().max()
    assert delta < 1e-4
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.n_encoded == 35 and layer.sink_slots[:, 0].tolist() == [[0, 1, 2, 3]] * 2
        for kind, states in (("key", exact.keys), ("value", exact.values)):
            assert torch.equal(layer._full(kind)[:, :, :4], states[:, :, :4])  # the sinks read back exactly


@pytest.mark.parametrize("storage", ["", f"+{INT4}"])
def test_sinks_are_the_first_real_tokens_stored_exactly(llama, storage):
    model, bases = llama
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    cache = make_cache(_spec(bases, f"lowrank:ratio=0.25,residual_length=0{storage}"), model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.n_encoded == 30
        assert layer.sink_slots[:, 0].tolist() == [[5, 6, 7, 8], [0, 1, 2, 3]]  # padding is no sink
        assert layer.sink_keys.shape == (2, layer.kv_heads, 4, layer.head_dim)  # every KV head's full key
        for kind, states in (("key", exact.keys), ("value", exact.values)):
            full = layer._full(kind)
            for row, first in ((0, 5), (1, 0)):
                assert torch.equal(full[row, :, first:first + 4], states[row, :, first:first + 4])
                for slot in range(first + 4, 30):  # projected on the bases
                    assert not torch.equal(full[row, :, slot], states[row, :, slot])


def test_without_sinks_the_first_tokens_are_projected(llama):
    model, bases = llama
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    cache = make_cache(_spec(bases, "lowrank:ratio=0.25,sink_tokens=0,residual_length=0"), model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    assert cache.layers[1].sink_slots is None and cache.layers[1].sink_keys is None
    assert not torch.equal(cache.layers[1]._full("key")[1, :, :4], reference.layers[1].keys[1, :, :4])


INT4_R4 = "int4:residual_length=4,group_size=8,key_axis=token"


@pytest.mark.parametrize(("spec", "without"), [
    ("lowrank:ratio=0.5", "lowrank:ratio=0.5,sink_tokens=0"),
    (f"lowrank:ratio=0.5+{INT4}", f"lowrank:ratio=0.5,sink_tokens=0+{INT4},sink_tokens=0"),
    (f"lowrank:ratio=0.5,sink_tokens=2+{INT4_R4},sink_tokens=0", f"lowrank:ratio=0.5,sink_tokens=0+{INT4_R4}"
     ",sink_tokens=0"),
    (f"lowrank:ratio=0.5,sink_tokens=0+{INT4_R4}", f"lowrank:ratio=0.5,sink_tokens=0+{INT4_R4},sink_tokens=0"),
    (f"lowrank:ratio=0.5,sink_tokens=3+{INT4_R4},sink_tokens=5", f"lowrank:ratio=0.5,sink_tokens=0+{INT4_R4}"
     ",sink_tokens=0"),
])
def test_sinks_bytes_are_exact(llama, spec, without):
    """The sinks hold every KV head's full key and value and an int64 slot each; the cache promises them, the
    tensors measure them, and the study's estimate counts them."""
    model, bases = llama
    spec, without = _spec(bases, spec), _spec(bases, without)
    ids, mask = _padded_prompts()
    sinks, plain = make_cache(spec, model.config), make_cache(without, model.config)
    generate(model, ids, mask, sinks, max_new_tokens=5)
    generate(model, ids, mask, plain, max_new_tokens=5)
    assert plain.layers[0].sink_slots is None
    assert measured_kv_bytes(sinks) == sinks.promised_kv_bytes()
    assert measured_kv_bytes(plain) == plain.promised_kv_bytes()
    layer = sinks.layers[0]
    count = sinks.codec.exact_sinks
    assert layer.sink_keys.shape == (2, layer.kv_heads, count, layer.head_dim)
    rows = layer.batch_size * layer.kv_heads
    extra = rows * count * ((layer.head_dim + layer.value_dim) * 4 + 8)  # fp32 keys and values, int64 slot
    assert measured_kv_bytes(sinks) - measured_kv_bytes(plain) == extra * len(sinks.layers)
    # The study's estimate for one row counts the sinks as the cache holds them.
    single = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[1:], cache=single)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 30, 4) == pytest.approx(single.promised_kv_bytes() - bookkeeping)


@pytest.mark.parametrize("spec", [f"lowrank:ratio=0.5+{INT4}", "h2o:budget=8,recent=2+lowrank:ratio=0.5",
                                  "tova:ratio=0.5+lowrank:ratio=0.25,sink_tokens=3"])
def test_padded_rows_with_sinks_match_rows_alone(llama, spec):
    model, bases = llama
    spec = _spec(bases, spec)
    cache = padded_batch_against_rows_alone(model, spec)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert all(layer.sink_slots is not None for layer in cache.layers)


def test_sinks_follow_an_evicting_policy(llama):
    """The policy protects its first 4 tokens: after it evicts, lowrank's sinks still decode exactly."""
    model, bases = llama
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    _forward(model, ids, mask, reference)
    cache = make_cache(_spec(bases, "h2o:budget=12,recent=4,sink_tokens=4+lowrank:ratio=0.25"), model.config)
    generate(model, ids, mask, cache, max_new_tokens=3)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.seen == 32 and layer.stored_tokens < 20 and bool((layer.sink_slots >= 0).all())
        for row, first in ((0, 5), (1, 0)):
            slots = layer.sink_slots[row, :, :, None]  # [H, 4, 1]
            for kind, states in (("key", exact.keys), ("value", exact.values)):
                kept = layer._full(kind)[row].gather(1, slots.expand(-1, -1, states.shape[-1]))
                assert torch.equal(kept, states[row, :, first:first + 4])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
