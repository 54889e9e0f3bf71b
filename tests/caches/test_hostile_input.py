"""Odd and hostile input: each case gets the right answer or a clear error, never a silently wrong cache."""

import threading

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.generation import generate

from .tiny_models import tiny_model

SPECS = ["dynamic", "int8", "int4:residual_length=4,group_size=8", "fp8", "sink_window:sink_tokens=2,window=6",
         "h2o:budget=8,recent=3+int8"]


def _ids(length=10, batch=1, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_empty_prompt_and_zero_new_tokens_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), None, make_cache("int8", model.config))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, _ids(), None, make_cache("int8", model.config), max_new_tokens=0)


def test_a_row_of_only_padding_leaves_the_other_row_alone():
    from hf_kvcompress import use_kvcompress_attention

    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(12, batch=2, seed=1)
    mask = torch.ones_like(ids)
    mask[0] = 0  # the first row is nothing but padding
    for spec in ("dynamic", "sink_window:sink_tokens=2,window=6", "h2o:budget=8,recent=3",
                 "expected_attention:budget=8,window=4"):
        out = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=6).new_tokens
        alone = generate(model, ids[1:], None, make_cache(spec, model.config), max_new_tokens=6).new_tokens
        assert torch.equal(out[1], alone[0]), spec
    ref = generate(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=6).new_tokens
    ours = generate(model, ids, mask, make_cache("dynamic", model.config), max_new_tokens=6).new_tokens
    assert torch.equal(ours, ref)


def test_budget_larger_than_the_context_keeps_everything():
    model = tiny_model("llama")
    ids = _ids(10)
    cache = make_cache("sink_window:sink_tokens=4,window=500", model.config)
    generate(model, ids, None, cache, max_new_tokens=4)
    dynamic = make_cache("dynamic", model.config)
    generate(model, ids, None, dynamic, max_new_tokens=4)
    assert cache.stored_tokens == dynamic.stored_tokens == 13
    assert measured_kv_bytes(cache) == measured_kv_bytes(dynamic)


def test_context_beyond_the_models_positions():
    # RoPE models run past max_position_embeddings (and streaming caches exist for that); learned positions cannot.
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    from hf_kvcompress import SinkWindowCache

    cache = SinkWindowCache(sink_tokens=2, window=8, config=config, rerotate=True)
    out = generate(model, _ids(40), None, cache, max_new_tokens=10)
    assert out.new_tokens.shape == (1, 10) and cache.get_seq_length() == 49
    gpt2 = tiny_model("gpt2")  # 256 learned positions
    with pytest.raises(ValueError, match="256 learned positions"):
        generate(gpt2, _ids(250), None, make_cache("sink_window:window=16", gpt2.config), max_new_tokens=10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", SPECS)
def test_half_precision_models(dtype, spec):
    from hf_kvcompress import use_kvcompress_attention

    model = use_kvcompress_attention(tiny_model("llama")).to(dtype)
    cache = make_cache(spec, model.config)
    out = generate(model, _ids(20, batch=2), None, cache, max_new_tokens=5)
    assert out.new_tokens.shape == (2, 5)
    assert all(layer.dtype == dtype for layer in cache.layers)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_states_on_another_device_are_refused():
    model = tiny_model("llama")
    cache = make_cache("int8", model.config)
    generate(model, _ids(), None, cache, max_new_tokens=2)
    states = torch.zeros(1, 2, 1, 32, device="meta")
    with pytest.raises(ValueError, match="load_cache"):
        cache.update(states, states, 0)


def test_another_batch_size_is_refused_until_reset():
    model = tiny_model("llama")
    cache = make_cache("int8", model.config)
    generate(model, _ids(batch=2), None, cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="reset"):
        generate(model, _ids(14, batch=3), None, cache, max_new_tokens=2)
    cache.reset()
    assert generate(model, _ids(14, batch=3), None, cache, max_new_tokens=2).new_tokens.shape == (3, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=0,group_size=8", "fp8"])
def test_non_finite_keys_are_refused(spec, bad):
    cache = make_cache(spec)
    keys = torch.randn(1, 2, 8, 32)
    keys[0, 1, 3, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.update(keys, torch.randn(1, 2, 8, 32), 0)
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.update(torch.randn(1, 2, 8, 32), keys, 0)


def test_one_cache_used_from_two_threads_is_refused():
    model = tiny_model("llama")  # 2 layers
    cache = make_cache("int8", model.config)
    states = torch.randn(1, 2, 4, 32)
    cache.update(states, states, 0)  # this thread is between the first and the last layer of a step
    errors = []

    def other():
        try:
            cache.update(states, states, 0)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "another thread" in str(errors[0])
    cache.update(states, states, 1)  # the step ends: another thread may now take the cache
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1


def test_non_finite_first_step_leaves_the_layer_empty():
    cache = make_cache("int8")
    keys = torch.full((1, 2, 4, 32), float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.update(keys, keys, 0)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized
