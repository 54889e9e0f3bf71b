"""The fast decode path is what a user gets: plain `model.generate(cache=...)`, no `use_kvcompress_attention`.

Checked by what runs (the layers' store offers taken, the kernel's entry called), not by timing."""

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import QuantizedCache, load_model, make_cache, use_kvcompress_attention
from hf_kvcompress.hf.attention import ATTENTION_NAME, engage
from hf_kvcompress.ops import cpu_decode

from ..caches.tiny_models import tiny_model


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the C++ kernel attended a whole layer (store, sinks and tail) in one call."""
    calls = []
    original = cpu_decode.decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "decode_attention", counted)
    return calls


def test_the_quick_starts_int4_cache_reads_its_store_directly(store_reads, kernel_calls):
    model, tokenizer = load_model()  # a fresh model: no use_kvcompress_attention anywhere
    assert model.config._attn_implementation == "sdpa"
    text = "What is the capital of France? " * 30  # longer than the residual: the store holds encoded tokens
    messages = [{"role": "user", "content": text}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = QuantizedCache(bits=4, group_size=32, residual_length=128)  # as in the README, without a config
    new = 6
    out = model.generate(**inputs, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    layers = model.config.num_hidden_layers
    assert cache.layers[0].n_encoded > 0 and all(layer.offers.confirmed for layer in cache.layers)
    assert len(store_reads) == (new - 1) * layers  # every decode step of every layer read the store itself
    assert set(store_reads) == {"cpu"}  # through the C++ kernel
    assert len(kernel_calls) == len(store_reads)  # one call per layer and step: store, exact sinks and tail
    assert model.config._attn_implementation == ATTENTION_NAME
    # The same tokens as transformers' own path over the decoded store (a cache built from a copy of the config
    # cannot switch the model; the model is switched back to SDPA first).
    model.set_attn_implementation("sdpa")
    cache = QuantizedCache(bits=4, group_size=32, residual_length=128, config=copy.deepcopy(model.config))
    with pytest.warns(RuntimeWarning, match="does not run"):
        plain = model.generate(**inputs, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert len(store_reads) == (new - 1) * layers
    assert torch.equal(plain, out)


def test_a_model_from_transformers_is_switched_by_a_cache_built_with_its_config(store_reads):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = make_cache("int4:residual_length=8,group_size=8", model.config)
    model.generate(input_ids=ids, cache=cache, max_new_tokens=5, do_sample=False)
    assert model.config._attn_implementation == ATTENTION_NAME
    assert len(store_reads) == 4 * model.config.num_hidden_layers
    assert all(layer.offers.confirmed for layer in cache.layers)


def test_a_model_that_cannot_take_it_is_named_once_and_answers_right(store_reads):
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = make_cache("int4:residual_length=8,group_size=8", model.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(input_ids=ids, cache=cache, max_new_tokens=5, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    notes = [w for w in caught if "does not run" in str(w.message)]
    assert len(notes) == 1 and "'eager'" in str(notes[0].message)
    assert model.config._attn_implementation == "eager" and not store_reads
    assert torch.stack(out.logits).isfinite().all()


def test_kvcompress_sdpa_without_requests_is_transformers_sdpa_exactly():
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    plain = tiny_model("llama")
    switched = tiny_model("llama")
    assert engage(switched.config) == ATTENTION_NAME and switched.config._attn_implementation == ATTENTION_NAME
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask, cache=DynamicCache()).logits
        b = switched(input_ids=ids, attention_mask=mask, cache=DynamicCache()).logits
    assert torch.equal(a, b)
    assert engage(None) is None
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert engage(eager.config) == "eager"  # another implementation would answer differently: left as it is


def _padded_prompts(tokenizer):
    texts = ["The capital of France is a city where " * 12, "Water boils at"]
    return tokenizer(texts, return_tensors="pt", padding=True)


def _greedy(model, inputs, cache, new=8):
    out = model.generate(**inputs, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_dynamic_cache_answers_the_same_after_a_compressed_cache_switched_the_model():
    # The switch is for the model's life: everything it runs afterwards, DynamicCache included, goes through
    # 'kvcompress_sdpa', which must then be transformers' SDPA exactly (a padded batch: the mask matters).
    model, tokenizer = load_model()
    inputs = _padded_prompts(tokenizer)
    before_tokens, before_logits = _greedy(model, inputs, DynamicCache(config=model.config))
    assert model.config._attn_implementation == "sdpa"
    _greedy(model, inputs, QuantizedCache(bits=4, group_size=32, residual_length=32))
    assert model.config._attn_implementation == ATTENTION_NAME
    after_tokens, after_logits = _greedy(model, inputs, DynamicCache(config=model.config))
    assert torch.equal(after_tokens, before_tokens)
    assert torch.equal(after_logits, before_logits)


@pytest.mark.parametrize("spec", ["int4:residual_length=8,group_size=8", "h2o:budget=16,recent=4"])
def test_two_models_are_not_affected_by_each_others_cache(spec):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    first, second = tiny_model("llama"), tiny_model("llama")  # the same weights, each with its own config
    reference = second.generate(input_ids=ids, attention_mask=mask, cache=DynamicCache(), max_new_tokens=6,
                                do_sample=False)
    first.generate(input_ids=ids, attention_mask=mask, cache=make_cache(spec, first.config), max_new_tokens=6,
                   do_sample=False)
    assert first.config._attn_implementation == ATTENTION_NAME
    assert second.config._attn_implementation == "sdpa"  # the other model's cache switched only its own model
    again = second.generate(input_ids=ids, attention_mask=mask, cache=DynamicCache(), max_new_tokens=6,
                            do_sample=False)
    assert torch.equal(again, reference)
    # A cache without a config on a model from transformers switches nothing (it has no model to switch).
    plain = tiny_model("llama")
    with pytest.warns(RuntimeWarning, match="does not run"):  # and says so
        plain.generate(input_ids=ids, attention_mask=mask, cache=make_cache("int4:residual_length=8,group_size=8"),
                       max_new_tokens=3, do_sample=False)
    assert plain.config._attn_implementation == "sdpa" and second.config._attn_implementation == "sdpa"


def test_config_less_caches_switch_the_model_from_load_model_that_runs_them():
    first, tokenizer = load_model()
    second, _ = load_model()
    inputs = tokenizer(["What is the capital of France? " * 8], return_tensors="pt")
    cache = QuantizedCache(bits=4, group_size=32, residual_length=32)
    _greedy(first, inputs, cache, new=3)
    assert cache.attention_config is first.config
    assert first.config._attn_implementation == ATTENTION_NAME and second.config._attn_implementation == "sdpa"
    other = QuantizedCache(bits=4, group_size=32, residual_length=32)
    _greedy(second, inputs, other, new=3)
    assert other.attention_config is second.config and second.config._attn_implementation == ATTENTION_NAME


def test_an_attention_scored_policy_needs_no_use_kvcompress_attention():
    # H2O reads attention statistics: a cache built with the model's config switches a plain SDPA model at the
    # prompt, and answers as it does on a model switched by hand.
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    spec = "h2o:budget=12,recent=3"
    plain = tiny_model("llama")
    tokens, logits = _generate_tokens(plain, make_cache(spec, plain.config), ids, mask)
    assert plain.config._attn_implementation == ATTENTION_NAME
    switched = use_kvcompress_attention(tiny_model("llama"))
    by_hand, by_hand_logits = _generate_tokens(switched, make_cache(spec, switched.config), ids, mask)
    assert torch.equal(tokens, by_hand) and torch.equal(logits, by_hand_logits)


def _generate_tokens(model, cache, ids, mask):
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)
