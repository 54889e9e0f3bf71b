"""A spec's resolved digest changes with what the spec means on the model, not with how it is written."""

import transformers

from hf_kvcompress.eval.resolved import resolved_digest

from ..caches.tiny_models import CONFIGS


def _gemma():
    return transformers.Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=64, intermediate_size=64, vocab_size=64,
                                         sliding_window=16, layer_types=["sliding_attention", "full_attention"])


def test_plain_names_resolve_per_model_family_also_as_storage():
    llama, gemma = CONFIGS["llama"](), _gemma()
    for spec in ("int4", "shared_heads+int4", "h2o:budget=32,recent=8+int4"):
        assert resolved_digest(spec, llama) == resolved_digest(spec, CONFIGS["llama"]())
        assert resolved_digest(spec, llama) != resolved_digest(spec, gemma)
    assert resolved_digest("int4", llama) == resolved_digest("int4:rotate=auto", llama)  # written otherwise, same
    assert resolved_digest("dynamic", llama) == resolved_digest("dynamic", gemma)  # nothing settles per model


def test_settled_rope_frequencies_count():
    slow = transformers.LlamaConfig(**{**CONFIGS["llama"]().to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 500000.0}})
    assert resolved_digest("int2", CONFIGS["llama"]()) != resolved_digest("int2", slow)
    assert resolved_digest("int4", CONFIGS["llama"]()) == resolved_digest("int4", slow)  # int4 reads no RoPE
