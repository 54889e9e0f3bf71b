"""lowrank's own full-precision window (`residual_length`, 0 by default): the newest tokens bypass the bases and the
storage in the cache's tail, read back exactly, older ones are projected; the window is counted in the promised and
the measured bytes and in the study's estimate; beside a storage with a residual of its own (`+int4`) the stack
keeps the most either asks for."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, parse_spec
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.study import promised_bytes

from ..caches.test_sinks import _forward, _padded_prompts
from ..caches.tiny_models import padded_batch_against_rows_alone
from .test_lowrank_sinks import _spec, llama  # noqa: F401  # the module's fixture: tiny llama, joint bases

INT4 = "int4:residual_length=0,group_size=8,key_axis=token"  # everything encoded by int4 itself


def test_residual_length_default_compose_and_refuse_bad_values():
    # Below half of the dimensions (the default quarter included) the newest 128 tokens stay exact; a half and a
    # fixed rank keep none.
    assert LowRankCodec().residual_length == parse_spec("lowrank")[1].exact_residual == 128
    assert parse_spec("lowrank:ratio=0.25")[1].exact_residual == 128
    assert parse_spec("lowrank:ratio=0.5")[1].exact_residual == parse_spec("lowrank:rank=8")[1].exact_residual == 0
    assert parse_spec("lowrank:ratio=0.25,residual_length=0")[1].exact_residual == 0
    assert parse_spec("lowrank:residual_length=16")[1].exact_residual == 16
    assert parse_spec("lowrank+int4")[1].exact_residual == 128  # int4's own residual, as before
    assert parse_spec("lowrank:residual_length=256+int4")[1].exact_residual == 256  # the most either asks for
    assert parse_spec("lowrank:residual_length=16+int4")[1].exact_residual == 128
    assert parse_spec(f"lowrank:residual_length=16+{INT4}")[1].exact_residual == 16
    assert parse_spec("lowrank:residual_length=16+shared_heads+int8:residual_length=0")[1].exact_residual == 16
    assert parse_spec("lowrank:residual_length=16")[1].spec() == "lowrank:residual_length=16"
    for bad in (-1, 1.5, True, "all"):
        with pytest.raises(ValueError, match="residual_length must be an integer >= 0"):
            LowRankCodec(residual_length=bad)
    with pytest.raises(ValueError, match="residual_length"):
        parse_spec("lowrank:residual_length=-8")


@pytest.mark.parametrize("storage", ["", f"+{INT4}"])
def test_the_newest_tokens_read_exactly_and_older_ones_are_projected(llama, storage):  # noqa: F811
    model, bases = llama
    ids, mask = _padded_prompts()  # 30 slots, row 0 left-padded by 5
    reference = DynamicCache(config=model.config)
    cache = make_cache(_spec(bases, f"lowrank:ratio=0.25,sink_tokens=0,residual_length=8{storage}"), model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.n_encoded == 22 and layer.stored_tokens == 30
        for kind, states in (("key", exact.keys), ("value", exact.values)):
            full = layer._full(kind)
            assert torch.equal(full[:, :, 22:], states[:, :, 22:])  # the window: the model's own states
            for slot in range(5, 22):  # real tokens of both rows, projected on the bases
                assert not torch.equal(full[:, :, slot], states[:, :, slot])
    # Decoding one more token moves the oldest of the window into the projected store.
    with torch.no_grad():
        model(input_ids=ids[:, -1:], cache=cache, attention_mask=torch.cat([mask, mask[:, -1:]], 1))
    assert all(layer.n_encoded == 23 and layer.stored_tokens == 31 for layer in cache.layers)


@pytest.mark.parametrize("window", [0, 8, 24])
def test_window_bytes_are_exact(llama, window):  # noqa: F811
    """A token in the window costs its full key and value instead of its latent; the cache promises it, the tensors
    measure it, and the study's estimate counts it."""
    model, bases = llama
    spec = _spec(bases, f"lowrank:ratio=0.5,residual_length={window}")
    plain_spec = _spec(bases, "lowrank:ratio=0.5")
    ids, mask = _padded_prompts()
    windowed, plain = make_cache(spec, model.config), make_cache(plain_spec, model.config)
    generate(model, ids, mask, windowed, max_new_tokens=5)
    generate(model, ids, mask, plain, max_new_tokens=5)
    assert measured_kv_bytes(windowed) == windowed.promised_kv_bytes()
    exact = window  # of the 34 tokens stored: 30 of the prompt, 4 generated (the last one is not cached)
    extra = 0
    for i, layer in enumerate(windowed.layers):
        assert layer.stored_tokens == 34 and layer.n_encoded == 34 - exact
        key_rank, value_rank = layer.codec._ranks[i]
        full = layer.kv_heads * (layer.head_dim + layer.value_dim) * 4  # fp32 keys and values, every KV head
        # One latent per token and row, in the dtype the codec stores it in here (bf16 where the step computes in it)
        width = {kind: torch.empty((), dtype=layer.codec.latent_dtype(torch.float32, kind)).element_size()
                 for kind in ("key", "value")}
        extra += layer.batch_size * exact * (full - key_rank * width["key"] - value_rank * width["value"])
    assert measured_kv_bytes(windowed) - measured_kv_bytes(plain) == extra
    single = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[1:], cache=single)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 30, 4) == pytest.approx(single.promised_kv_bytes() - bookkeeping)


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5,residual_length=4", f"lowrank:ratio=0.25,residual_length=6+{INT4}",
                                  "tova:ratio=0.5+lowrank:ratio=0.25,residual_length=3"])
def test_padded_rows_with_a_window_match_rows_alone(llama, spec):  # noqa: F811
    model, bases = llama
    spec = _spec(bases, spec)
    cache = padded_batch_against_rows_alone(model, spec)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
