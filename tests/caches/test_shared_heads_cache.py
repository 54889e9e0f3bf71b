"""shared_heads in real caches: exact when a group's heads are equal, composes with eviction, refuses MQA models."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.codecs.shared_heads import SharedHeadsCodec
from hf_kvcompress.generation import generate

from .tiny_models import tiny_model

SPECS = ["shared_heads", "shared_heads:heads_per_group=2+int8:residual_length=4",
         "h2o:budget=8,recent=2+shared_heads:heads_per_group=2",
         "sink_window:sink_tokens=2,window=6+shared_heads+int4:group_size=16,residual_length=2"]


@pytest.fixture(scope="module")
def model():
    return use_kvcompress_attention(tiny_model("llama_mha"))  # 4 KV heads


def _duplicate_heads(model, group):
    """Make each group's KV heads equal, so sharing them loses nothing."""
    head_dim = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(-1, head_dim, proj.weight.shape[-1])
                for first in range(0, w.shape[0], group):
                    w[first:first + group] = w[first].clone()
    return model


def test_equal_heads_give_dynamic_cache_tokens():
    model = _duplicate_heads(use_kvcompress_attention(tiny_model("llama_mha")), 2)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    expected = generate(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=10).new_tokens
    for spec in ("shared_heads:heads_per_group=2", "h2o:budget=1000,recent=4+shared_heads:heads_per_group=2"):
        got = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=10).new_tokens
        assert torch.equal(got, expected), spec


def test_unequal_heads_change_the_answer(model):
    # The test above can fail: on a model whose heads differ, sharing them changes the logits.
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache, ref_cache = make_cache("shared_heads", model.config), DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache), model(input_ids=ids, cache=ref_cache)
        step = ids[:, -1:]
        ours, ref = model(input_ids=step, cache=cache).logits, model(input_ids=step, cache=ref_cache).logits
        assert not torch.allclose(ours, ref)


@pytest.mark.parametrize("spec", SPECS)
def test_padded_batch_matches_rows_alone_and_bytes_are_measured(model, spec):
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (5, 13, 9)]
    ids = torch.zeros(3, 13, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 13 - len(row):], mask[i, 13 - len(row):] = row, 1
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=8).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=8).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i} differs with {spec}"


def test_eviction_keeps_one_selection_per_group(model):
    cache = make_cache("h2o:budget=8,recent=2+shared_heads:heads_per_group=2", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    generate(model, ids, torch.ones_like(ids), cache, max_new_tokens=4)
    layer = cache.layers[0]
    assert layer.encoded_keys["states"].shape[1] == 2  # 4 KV heads stored as 2
    assert layer.stored_tokens == 8
    kept_tail = layer.tail_keys.shape[-2]
    assert layer.n_encoded + kept_tail == 8


def test_single_kv_head_model_and_missing_config_are_refused():
    with pytest.raises(ValueError, match="single KV head"):
        make_cache("shared_heads", tiny_model("gemma3").config)
    with pytest.raises(ValueError, match="config"):
        CompressedCache(codec=SharedHeadsCodec(heads_per_group=2))
    with pytest.raises(ValueError, match="heads_per_group must divide"):
        make_cache("shared_heads:heads_per_group=4", tiny_model("llama").config)
