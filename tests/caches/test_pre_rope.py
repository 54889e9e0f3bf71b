"""pre_rope keys inside real caches: RoPE frequencies from the config, padded rows, exact bytes, models without RoPE."""

import pytest
import torch

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.generation import generate
from hf_kvcompress.hf.rope import rope_inv_freq

from .tiny_models import tiny_model

SPEC = "int2:residual_length=0,group_size=8,rotate=hadamard,sink_tokens=2,codebook=gaussian,pre_rope=true"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma3"])
def test_pre_rope_cache_generates_pads_like_rows_alone_and_counts_bytes(family):
    model = tiny_model(family)
    cache = make_cache(SPEC, model.config)
    full_layers = [layer for layer in cache.layers if not layer.is_sliding]
    expected = tuple(rope_inv_freq(model.config, "full_attention").tolist())
    assert full_layers and all(layer.codec.inv_freq == expected for layer in full_layers)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (5, 13, 13)]  # row 0's padding is one whole group
    ids = torch.zeros(3, 13, dtype=torch.long)
    mask = torch.zeros(3, 13, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 13 - len(row):], mask[i, 13 - len(row):] = row, 1
    batched = generate(model, ids, mask, cache, max_new_tokens=8).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for i, row in enumerate(rows):
        alone = generate(model, row[None], None, make_cache(SPEC, model.config), max_new_tokens=8).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i} differs"
    assert make_cache(cache.spec, model.config).layers[0].codec == cache.layers[0].codec


def test_pre_rope_changes_nothing_on_a_model_without_rope():
    # GPT-2 never rotates its keys: they are pre-RoPE keys already, so pre_rope stores exactly what it would without.
    model = tiny_model("gpt2")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    outputs = []
    for spec in (SPEC, SPEC.replace("pre_rope=true", "pre_rope=false")):
        cache = make_cache(spec, model.config)
        outputs.append(generate(model, ids, None, cache, max_new_tokens=6).new_tokens)
    assert make_cache(SPEC, model.config).layers[0].codec.inv_freq == ()
    assert torch.equal(outputs[0], outputs[1])
