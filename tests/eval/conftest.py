"""Fixtures of the evaluation tests: short contexts (~300-600 tokens) on the embedded model from tests/conftest.py."""

import pytest


@pytest.fixture(scope="session")
def tokenizer(embedded):
    return embedded[1]


@pytest.fixture(scope="session")
def small_samples(tokenizer):
    """Four needle samples of ~300 tokens: depths 0 and 100, two lengths (index 0 of each cell, `split="all"`:
    the samples these tests were written on; the order of the runner's batches follows their lengths)."""
    from hf_kvcompress.eval import build_samples

    return build_samples(tokenizer, ["needle"], [300, 360], [0, 100], seed=0, split="all")


def count_batches(monkeypatch) -> list:
    """Record the (method, rows) of every batch `runner.run_batch` evaluates from now on (the batches still run)."""
    from hf_kvcompress.eval import runner

    calls = []
    real = runner.run_batch

    def count(model, spec, rows, *args, **kwargs):
        calls.append((spec, len(rows)))
        return real(model, spec, rows, *args, **kwargs)

    monkeypatch.setattr(runner, "run_batch", count)
    return calls


@pytest.fixture(scope="session")
def tiny_lm(tokenizer):
    """A 2-layer random Llama over the embedded tokenizer's vocabulary: fast runs of the runner on real samples
    (its answers are arbitrary but deterministic, and no token ends them)."""
    import torch
    import transformers

    from hf_kvcompress import use_kvcompress_attention

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = None
    return use_kvcompress_attention(model)
