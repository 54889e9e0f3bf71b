"""generation.py: prefill and generate on a tiny model, and what a prefilled cache can be handed to afterwards."""

import copy

import pytest
import torch

from hf_kvcompress import load_cache, make_cache, prefill, save_cache, use_kvcompress_attention

from .caches.tiny_models import tiny_model

REPEAT = [5, 6, 7]  # a stand-in reconstruction prompt for KVzip on a model without a tokenizer


def _greedy(model, ids, cache, n=6, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=n,
                          do_sample=False, temperature=None, top_p=None, top_k=None, **kwargs)[:, ids.shape[1]:]


@pytest.mark.parametrize("spec", [
    "int4:residual_length=4,group_size=4", "snapkv:ratio=0.5", "kvzip:ratio=0.5,budgets=uniform",
    "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=0.5,budgets=layer", "kvzip:ratio=0.5",
])
def test_a_prefilled_cache_serves_transformers_generate(spec, tmp_path):
    # prefill ran under torch.inference_mode, so generate() (under no_grad) raised "Inplace update to inference
    # tensor outside InferenceMode" at the first in-place update of the cache's bookkeeping.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = make_cache(spec, model.config)
    prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=REPEAT)
    copied = copy.deepcopy(cache)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors")
    first = _greedy(model, ids, cache)
    assert first.shape == (1, 6)
    assert torch.equal(_greedy(model, ids, copied), first)
    assert torch.equal(_greedy(model, ids, loaded), first)
