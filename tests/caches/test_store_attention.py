"""Attention read from the encoded store a block at a time equals SDPA over the decoded cache (the reference)."""

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_kvcompress import make_cache, use_kvcompress_attention
from hf_kvcompress.caches import store_attention
from hf_kvcompress.hf.attention import kvcompress_attention

from .tiny_models import tiny_model, write_key_scales

KV_HEADS, GROUPS, DIM = 2, 3, 32
CONFIG = LlamaConfig(hidden_size=KV_HEADS * GROUPS * DIM, num_attention_heads=KV_HEADS * GROUPS,
                     num_key_value_heads=KV_HEADS, head_dim=DIM, num_hidden_layers=1, intermediate_size=64,
                     vocab_size=64)


class _Module:
    def __init__(self, layer_idx):
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, GROUPS, True


def _mask(pads, new, kv):
    causal = torch.ones(new, kv, dtype=torch.bool).tril(kv - new)[None, None]
    return causal & (torch.arange(kv)[None, None, None, :] >= pads[:, None, None, None])


SPECS = [
    "int4:residual_length=8,group_size=8",  # KIVI keys per channel, Hadamard rotation, 4 exact sinks
    "int2:residual_length=4,group_size=16,key_axis=token,pre_rope=false",
    "int8:residual_length=0", "fp8:sink_tokens=2",
    # Keys per token: scales folded into the products for both keys and values (codecs/plane_attention.py).
    "int4:residual_length=8,group_size=8,key_axis=token",
    "int2:residual_length=4,group_size=8,key_axis=token,pre_rope=false",  # Gaussian levels, 4 groups per head
    "int8:residual_length=0,group_size=8,key_axis=token",
    # pre_rope per-channel keys (int2's plain name): one query per offset in a key group; at 3 bits decoded.
    "int2:residual_length=4,group_size=8", "int3:residual_length=4,group_size=8,pre_rope=true",
    "int2:residual_length=4,group_size=8,rotate=per_token",  # keys meet the query unrotated, values rotated back
    "sink_window:sink_tokens=2,window=20+int4:residual_length=4,group_size=8",
    "h2o:budget=24,recent=4+fp8",  # scored by attention: never fused, must still run
]


@pytest.mark.parametrize("spec", SPECS)
def test_fused_decode_attention_matches_sdpa_over_the_decoded_cache(spec, monkeypatch):
    _fused_against_sdpa_over_the_decoded_cache(spec, CONFIG, monkeypatch)


@pytest.mark.parametrize("spec", ["sink_window:sink_tokens=2,window=20+int4:residual_length=4,group_size=8",
                                  "int4:residual_length=8,group_size=8,key_axis=token,rotate=none"])
def test_fused_decode_attention_reads_scaled_keys_as_sdpa_reads_them_decoded(spec, monkeypatch, tmp_path):
    """key_scale: the query takes the channel scales the stored keys were divided by."""
    config = copy.deepcopy(CONFIG)
    path = write_key_scales(tmp_path, config)
    cache = _fused_against_sdpa_over_the_decoded_cache(f"{spec},key_scale={path}", config, monkeypatch)
    assert cache.layers[0].codec.layer_key_scale is not None


def _fused_against_sdpa_over_the_decoded_cache(spec, config, monkeypatch):
    monkeypatch.setattr(store_attention, "STORE_BLOCK", 16)  # several blocks, and blocks that split sinks off
    g = torch.Generator().manual_seed(0)
    cache = make_cache(spec, config)  # pre_rope reads the RoPE frequencies from the config
    layer_module = _Module(0)
    tokens, pads = 40, torch.tensor([3, 0])  # row 0 left-padded (our prefill's position 1 for padding)
    padded_row = torch.cat([torch.ones(3, dtype=torch.long), torch.arange(1, tokens - 2)])
    positions = torch.stack([padded_row, torch.arange(tokens)])
    keys = torch.randn(2, KV_HEADS, tokens, DIM, generator=g) * 3
    values = torch.randn(2, KV_HEADS, tokens, DIM, generator=g)
    query = torch.randn(2, KV_HEADS * GROUPS, tokens, DIM, generator=g)
    k, v = cache.update(keys, values, 0, kwargs := {"position_ids": positions})
    kvcompress_attention(layer_module, query, k, v, _mask(pads, tokens, k.shape[-2]), scaling=DIM ** -0.5, **kwargs)
    layer = cache.layers[0]
    fused_steps = 0
    for step in range(30):
        kwargs = {"position_ids": positions[:, -1:] + 1 + step}
        key, value = torch.randn(2, KV_HEADS, 1, DIM, generator=g), torch.randn(2, KV_HEADS, 1, DIM, generator=g)
        q = torch.randn(2, KV_HEADS * GROUPS, 1, DIM, generator=g)
        # A decode step adds no padding; eviction (in update or after attention) may drop some.
        pads = layer.pads.clone()
        k, v = cache_out = cache.update(key, value, 0, kwargs)
        mask = _mask(pads, 1, k.shape[-2])  # what transformers' mask says once each row's padding is counted
        fused = layer.offers.request is not None and layer.offers.request.fused
        if fused:  # update returned placeholders and left eviction and encoding to attention: decode the cache now
            assert k.isnan().all()
            k, v = layer._full("key"), layer._full("value")
        reference, _ = sdpa_attention_forward(layer_module, q, k, v, mask, scaling=DIM ** -0.5)
        fused_steps += fused
        out, _ = kvcompress_attention(layer_module, q, *cache_out, mask, scaling=DIM ** -0.5, **kwargs)
        torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)
    assert fused_steps == (0 if spec.startswith("h2o") else 30)  # the prompt step confirmed our attention function
    return cache


def _generate(model, spec, ids, mask, switches=True):
    # Built from a copy of the model's config, the cache cannot switch the model's attention
    # (CompressedCache._engage_attention switches the config it was given).
    cache = make_cache(spec, model.config if switches else copy.deepcopy(model.config))
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


@pytest.mark.parametrize("spec", ["int4:residual_length=8,group_size=8", "int2:group_size=16,residual_length=0",
                                  "sink_window:sink_tokens=2,window=12+fp8"])
def test_generate_with_the_fused_path_equals_plain_sdpa(spec):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    plain = tiny_model("llama")  # transformers' SDPA, and a cache that cannot switch it: it never reads its store
    tokens, logits = _generate(plain, spec, ids, mask, switches=False)
    assert plain.config._attn_implementation == "sdpa"
    fused = use_kvcompress_attention(tiny_model("llama"))
    fused_tokens, fused_logits = _generate(fused, spec, ids, mask)
    assert torch.equal(fused_tokens, tokens)
    torch.testing.assert_close(fused_logits, logits, atol=1e-4, rtol=1e-4)


def test_a_foreign_attention_function_after_fused_steps_is_refused():
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("int4:residual_length=0,group_size=8", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.layers[0].offers.confirmed
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # a decode step the cache relied on us for
        with pytest.raises(RuntimeError, match="kvcompress_sdpa"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_a_prompt_through_another_attention_function_withdraws_the_confirmation():
    # Each prompt step asks again: under transformers' SDPA nothing is fused, and the output is right.
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("int4:residual_length=0,group_size=8", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    model.set_attn_implementation("sdpa")
    out = model.generate(input_ids=torch.cat([ids, ids[:, :8]], 1), cache=cache, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert not cache.layers[0].offers.confirmed
    assert torch.stack(out.logits).isfinite().all()


def test_the_first_decode_step_is_fused_after_a_prompt_through_our_attention():
    # The prompt step asks whether our attention function runs, so no decode step decodes the whole store.
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("int4:residual_length=0,group_size=8", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert not cache.layers[0].offers.confirmed
        k, _ = cache.layers[0].update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), {})
    # Under transformers' own SDPA the prompt confirms nothing: the first decode step returns the decoded cache.
    plain = tiny_model("llama")
    other = make_cache("int4:residual_length=0,group_size=8")  # without the config: it cannot switch the attention
    with torch.inference_mode():
        plain(input_ids=ids, past_key_values=other, use_cache=True)
        k_plain, _ = other.layers[0].update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), {})
    assert k.isnan().all() and not k_plain.isnan().any()
