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
