"""crop() as transformers 5.24 calls it: the number of newest tokens to remove, 0 or negative.

generate() calls `crop(0)` whenever every draft token of prompt-lookup or assisted decoding is accepted, so a
cache that reads 0 as "keep 0 tokens" answers garbage in silence.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import SinkWindowCache, make_cache, use_kvcompress_attention

from .tiny_models import tiny_model

LOSSLESS = ["dynamic", "sink_window:sink_tokens=4,window=1000", "h2o:budget=1000,recent=10",
            "expected_attention:budget=1000"]
LOSSY = ["int8", "int4:residual_length=16,group_size=8", "fp8", "h2o:budget=1000,recent=10+int8"]


def _filled(spec, tokens=12, model_name="llama"):
    model = tiny_model(model_name)
    cache = make_cache(spec, model.config)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    return model, cache, ids


@pytest.mark.parametrize("spec", ["dynamic", "int8", "int4:residual_length=4,group_size=4", "fp8"])
def test_crop_zero_removes_nothing(spec):
    _, cache, _ = _filled(spec)
    before = [layer.stored_tokens for layer in cache.layers]
    cache.crop(0)
    assert cache.get_seq_length() == 12
    assert [layer.stored_tokens for layer in cache.layers] == before


@pytest.mark.parametrize("spec", ["dynamic", "fp8"])
def test_crop_removes_the_newest_tokens_and_matches_a_shorter_prefill(spec):
    model, cache, ids = _filled(spec)
    cache.crop(-3)
    assert cache.get_seq_length() == 9
    shorter = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :9], cache=shorter)
        nxt = ids[:, 9:10]
        a = model(input_ids=nxt, cache=cache).logits
        b = model(input_ids=nxt, cache=shorter).logits
    assert torch.allclose(a, b, atol=1e-5)  # prefills of 12 and 9 tokens round differently in the last bits


def test_crop_refuses_positive_counts_and_removing_more_than_seen():
    _, cache, _ = _filled("dynamic")
    with pytest.raises(ValueError, match="tokens_to_remove"):
        cache.crop(5)
    with pytest.raises(ValueError, match="tokens_to_remove"):
        cache.crop(-13)
    assert cache.get_seq_length() == 12


def test_crop_trims_rerotation_positions():
    model = tiny_model("llama")
    cache = SinkWindowCache(sink_tokens=2, window=100, config=model.config, rerotate=True)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    cache.crop(-4)
    for layer in cache.layers:
        assert layer.positions.shape[-1] == layer.stored_tokens == 8
        assert layer.positions[0, 0].tolist() == list(range(8))


def test_crop_forgets_the_queries_of_the_removed_tokens():
    model = use_kvcompress_attention(tiny_model("llama"))
    spec = "expected_attention:ratio=1.0,window=16,decoding=evict"  # the queries held between steps
    cache, shorter = make_cache(spec, model.config), make_cache(spec, model.config)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids[:, :9], cache=shorter)
    cache.crop(-3)
    for cropped, fresh in zip(cache.layers, shorter.layers, strict=True):
        assert cropped.next_position.tolist() == fresh.next_position.tolist() == [9]
        torch.testing.assert_close(cropped.recent_queries[:, :, -9:], fresh.recent_queries[:, :, -9:])
        counted = [layer.scorer.window(layer).counted.sum() for layer in (cropped, fresh)]
        assert counted[0] == counted[1] == 9 - 4  # 4 sinks


def _lookup_prompt(n=24):
    # A repetitive prompt, so prompt-lookup finds long matches and generate() calls crop(0) and crop(-k).
    g = torch.Generator().manual_seed(2)
    motif = torch.randint(3, 128, (6,), generator=g)
    return motif.repeat(n // 6)[None]


def _run(model, cache, ids, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=20,
                          do_sample=False, **kwargs)[:, ids.shape[1]:]


@pytest.mark.parametrize("spec", LOSSLESS)
@pytest.mark.parametrize("mode", ["prompt_lookup", "assisted"])
def test_speculative_decoding_matches_dynamic_cache(spec, mode):
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _lookup_prompt()
    ref = _run(model, DynamicCache(config=model.config), ids)
    kwargs = {"prompt_lookup_num_tokens": 10} if mode == "prompt_lookup" else {"assistant_model": model}
    assert torch.equal(_run(model, make_cache(spec, model.config), ids, **kwargs), ref)


@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_codecs_survive_prompt_lookup(spec):
    # Codecs with a full-precision residual encode a block as it leaves the residual, which a multi-token step does
    # at other queries than single steps, so tokens may differ from plain decoding (fp8 does not: see below); what
    # must hold is that crop(0) keeps the cache and the answer has the same length as plain decoding's.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _lookup_prompt()
    cache = make_cache(spec, model.config)
    out = _run(model, cache, ids, prompt_lookup_num_tokens=10)
    assert out.shape == (1, 20)
    assert cache.get_seq_length() == ids.shape[1] + 19


@pytest.mark.parametrize("spec", ["fp8", "fp8:sink_tokens=2", "h2o:budget=1000,recent=10+fp8"])
@pytest.mark.parametrize("mode", ["prompt_lookup", "assisted"])
def test_fp8_answers_its_own_greedy_tokens_under_speculative_decoding(spec, mode):
    # fp8 has no full-precision residual: a verification step read its draft tokens at full precision, where
    # decoding one at a time reads them as stored, so prompt lookup answered other tokens than fp8's greedy ones
    # (SmolLM2, 275-token prompt: from new token 27). Random weights rarely flip a token: compare the logits.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _lookup_prompt(48)
    kwargs = {"prompt_lookup_num_tokens": 10} if mode == "prompt_lookup" else {"assistant_model": model}
    runs = [
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=make_cache(spec, model.config),
                       max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True, **extra)
        for extra in ({}, kwargs)
    ]
    assert torch.equal(runs[1].sequences, runs[0].sequences)
    torch.testing.assert_close(torch.stack(runs[1].logits), torch.stack(runs[0].logits), atol=1e-5, rtol=0)
