"""The caches on the real embedded model (SmolLM2-135M-Instruct): bytes, fidelity and the lesson's point."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.budget import kv_bytes
from hf_kvcompress.codecs.fp8 import Fp8Codec
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.hf.compat import cache_kwargs

PROSE = (
    "An LLM writes one token at a time, and to avoid redoing work it stores a key and a value vector for every past "
    "token in every layer. That cache grows with context length and with the number of users, and it quickly becomes "
    "the main memory cost of serving. Quantization, eviction, sharing heads and low-rank compression each shrink a "
    "different factor of its size, and they stack. "
)


def _chat_ids(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids


def test_dynamic_cache_bytes_equal_the_formula(embedded):
    model, tokenizer = embedded
    ids = tokenizer(PROSE * 3, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    cfg = model.config
    expected = kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, ids.shape[1])
    assert measured_kv_bytes(cache) == expected


@pytest.mark.parametrize("spec", ["dynamic", "int4", "int2", "fp8", "sink_window:window=64",
                                  "h2o:budget=96,recent=32+int8"])
def test_measured_bytes_equal_each_methods_promise(embedded, spec):
    model, tokenizer = embedded
    ids = _chat_ids(tokenizer, PROSE * 3)
    cache = make_cache(spec, model.config)
    generate(model, ids, None, cache, max_new_tokens=4)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_int4_holds_five_sixteenths_of_fp16_for_its_quantized_part(embedded):
    model, tokenizer = embedded
    ids = tokenizer(PROSE * 4, return_tensors="pt").input_ids[:, :300]
    cache = make_cache("int4", model.config)  # group 32, residual 128
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    layer = cache.layers[0]
    assert layer.n_encoded == 160 and layer.stored_tokens == 300  # 300 - 128 = 172 -> five whole groups of 32
    cfg = model.config
    fp16_quantized = kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2, 160)
    fp32_residual = kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, 140)
    bookkeeping = cfg.num_hidden_layers * 2 * 8
    # int4's 4 full-precision sinks: fp32 key and value plus an int64 slot, per layer and KV head
    sinks = cfg.num_hidden_layers * cfg.num_key_value_heads * 4 * (2 * cfg.head_dim * 4 + 8)
    assert measured_kv_bytes(cache) == fp16_quantized * (4 + 32 / 32) / 16 + fp32_residual + bookkeeping + sinks


def test_int8_gives_dynamic_cache_greedy_tokens(embedded):
    model, tokenizer = embedded
    prompts = [
        PROSE * 2 + "\n\nIn one sentence, what limits serving memory for long prompts?",
        PROSE * 3 + "\n\nName the four families of KV cache compression.",
    ]
    for prompt in prompts:
        ids = _chat_ids(tokenizer, prompt)
        assert ids.shape[1] > 160  # beyond the 128-token residual: tokens really are quantized
        ref = generate(model, ids, None, make_cache("dynamic", model.config), max_new_tokens=24).new_tokens
        out = generate(model, ids, None, make_cache("int8", model.config), max_new_tokens=24).new_tokens
        assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def real_states(embedded):
    model, tokenizer = embedded
    ids = tokenizer(PROSE * 4, return_tensors="pt").input_ids[:, :256]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    return [(layer.keys, layer.values) for layer in cache.layers]


# Worst relative error over the 30 layers (measured: int8 0.003/0.006, int4 0.049/0.103, int2 0.25/0.56,
# fp8 0.023/0.025).
@pytest.mark.parametrize(
    "codec,key_bound,value_bound",
    [
        (IntNCodec(bits=8, key_axis="channel"), 0.01, 0.01),
        (IntNCodec(bits=4, key_axis="channel"), 0.07, 0.13),
        (IntNCodec(bits=2, key_axis="channel"), 0.32, 0.65),
        (IntNCodec(bits=4, key_axis="token"), 0.13, 0.13),
        (Fp8Codec(), 0.03, 0.03),
    ],
)
def test_codec_error_on_real_keys_and_values_is_bounded(real_states, codec, key_bound, value_bound):
    for keys, values in real_states:
        for kind, states, bound in (("key", keys, key_bound), ("value", values, value_bound)):
            decoded = codec.decode(codec.encode(states, kind), kind, states.dtype)
            assert (decoded - states).norm() / states.norm() < bound


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _passkey_prompt(tokenizer, passkey="68142", repeats=80):
    """~2,000 tokens with the passkey in the middle; returns (document ids, question ids), question last."""
    half = FILLER * (repeats // 2)
    document = (
        "There is a pass key hidden in the following text. Find it and memorize it.\n"
        + half + f"The pass key is {passkey}. Remember it. {passkey} is the pass key. " + half
    )
    messages = [{"role": "user", "content": document + "\n\nWhat is the pass key? Answer with the number only."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cut = rendered.index(document) + len(document)
    doc_ids = tokenizer(rendered[:cut], return_tensors="pt", add_special_tokens=False).input_ids
    question_ids = tokenizer(rendered[cut:], return_tensors="pt", add_special_tokens=False).input_ids
    return doc_ids, question_ids


def _answer_after_document(model, tokenizer, spec):
    doc_ids, question_ids = _passkey_prompt(tokenizer)
    cache = make_cache(spec, model.config)
    prefill(model, doc_ids, None, cache, chunk_size=512)  # the document is compressed before the question exists
    kept_before_question = cache.stored_tokens
    ids = torch.cat([doc_ids, question_ids], dim=1)
    answer = generate(model, ids, None, cache, max_new_tokens=10).new_tokens[0]
    return tokenizer.decode(answer, skip_special_tokens=True), doc_ids.shape[1], kept_before_question


def test_the_lessons_point_on_the_real_model(embedded):
    model, tokenizer = embedded
    answers = {spec: _answer_after_document(model, tokenizer, spec)
               for spec in ("dynamic", "int4", "sink_window:sink_tokens=4,window=256", "h2o:budget=260,recent=64")}
    doc_tokens = answers["dynamic"][1]
    assert 1800 <= doc_tokens <= 2300
    assert "68142" in answers["dynamic"][0]
    assert "68142" in answers["int4"][0]
    assert answers["sink_window:sink_tokens=4,window=256"][2] == 260
    assert "68142" not in answers["sink_window:sink_tokens=4,window=256"][0]
    print(f"\nH2O at a 260-token budget answered {answers['h2o:budget=260,recent=64'][0]!r}")


@pytest.mark.parametrize("spec", ["int4", "int2:residual_length=32", "fp8", "sink_window:window=64+int8",
                                  "int3:sink_tokens=4,rotate=hadamard", "sink_window:window=64+int4:sink_tokens=8",
                                  "int2:residual_length=32,wide_layers=7/18/23"])
def test_studys_analytic_bytes_equal_a_real_caches_promise(embedded, spec):
    from hf_kvcompress.study import promised_bytes

    model, tokenizer = embedded
    ids = tokenizer(PROSE * 3, return_tensors="pt").input_ids[:, :240]
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    bookkeeping = model.config.num_hidden_layers * 2 * 8
    assert promised_bytes(spec, model.config, 240, 4) == cache.promised_kv_bytes() - bookkeeping
