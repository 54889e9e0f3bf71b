"""Full-precision sinks: a lossy codec's `sink_tokens` first real tokens of each row are stored exactly."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.generation import generate

from .tiny_models import tiny_model


def _padded_prompts():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: five padding slots first
    return ids, mask


def _forward(model, ids, mask, cache):
    """One prefill with generate()'s position ids (padding at position 1), from which layers count padding."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)


@pytest.mark.parametrize("spec", ["int2:residual_length=0,group_size=8,key_axis=token,sink_tokens=3",
                                  "int3:residual_length=0,group_size=8,rotate=hadamard,key_axis=token,sink_tokens=3",
                                  "fp8:sink_tokens=3"])
def test_sinks_are_the_first_real_tokens_and_decode_exactly(spec):
    model = tiny_model("llama")
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    cache = make_cache(spec, model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    layer = cache.layers[1]
    assert layer.sink_slots[:, 0].tolist() == [[5, 6, 7], [0, 1, 2]]
    keys, values = layer._full("key"), layer._full("value")
    exact_keys, exact_values = reference.layers[1].keys, reference.layers[1].values
    for row, first in ((0, 5), (1, 0)):
        sinks = slice(first, first + 3)
        assert torch.equal(keys[row, :, sinks], exact_keys[row, :, sinks])
        assert torch.equal(values[row, :, sinks], exact_values[row, :, sinks])
        # the next token is quantized
        assert not torch.equal(keys[row, :, first + 3], exact_keys[row, :, first + 3])


def test_without_sinks_the_first_tokens_are_quantized():
    model = tiny_model("llama")
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    cache = make_cache("int2:residual_length=0,group_size=8,key_axis=token,sink_tokens=0", model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    assert cache.layers[1].sink_slots is None
    assert not torch.equal(cache.layers[1]._full("key")[1, :, :3], reference.layers[1].keys[1, :, :3])


def test_sinks_follow_eviction_and_bytes_match_the_promise():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    reference = DynamicCache(config=model.config)
    spec = "sink_window:sink_tokens=2,window=10+int4:residual_length=2,group_size=8,sink_tokens=2,rotate=hadamard"
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=reference)
        model(input_ids=ids, cache=cache)
    layer = cache.layers[0]
    assert layer.sink_slots[0, 0].tolist() == [0, 1]
    assert torch.equal(layer._full("key")[:, :, :2], reference.layers[0].keys[:, :, :2])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_a_sink_evicted_by_the_policy_is_forgotten():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = make_cache("sink_window:sink_tokens=1,window=10+int8:residual_length=2,group_size=8,sink_tokens=3",
                       model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    # The policy keeps one sink: the codec's second and third sink tokens were evicted, so their slots are gone.
    assert cache.layers[0].sink_slots[0, 0].tolist() == [0, -1, -1]


def test_plain_low_bit_names_keep_four_sinks():
    from hf_kvcompress import parse_spec

    for name in ("int4", "int3", "int2"):
        assert parse_spec(name)[1].sink_tokens == 4 and parse_spec(name)[1].rotate == "auto"
    assert parse_spec("int8")[1].sink_tokens == 0


def test_sink_bytes_are_counted_and_generation_matches_the_promise():
    model = tiny_model("llama")
    ids, mask = _padded_prompts()
    plain = make_cache("int4:residual_length=4,group_size=8,sink_tokens=0", model.config)
    sinks = make_cache("int4:residual_length=4,group_size=8,sink_tokens=4", model.config)
    generate(model, ids, mask, plain, max_new_tokens=9)
    generate(model, ids, mask, sinks, max_new_tokens=9)
    assert measured_kv_bytes(sinks) == sinks.promised_kv_bytes()
    layer = sinks.layers[0]
    rows = layer.batch_size * layer.kv_heads
    extra = rows * 4 * ((layer.head_dim + layer.value_dim) * 4 + 8)  # fp32 keys and values, int64 slot
    assert measured_kv_bytes(sinks) - measured_kv_bytes(plain) == extra * len(sinks.layers)
