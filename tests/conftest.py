"""Shared fixtures: the embedded model, loaded once per test session (offline)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU, Triton kernels run in Triton's interpreter (tests/ops/test_triton_decode.py). Triton reads this when
# it is imported, which other libraries may do before that test module is collected: set it first.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, switched to the statistics-gathering attention."""
    from hf_kvcompress import load_model, use_kvcompress_attention

    model, tokenizer = load_model()
    return use_kvcompress_attention(model), tokenizer
