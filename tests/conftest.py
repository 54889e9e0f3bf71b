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


@pytest.fixture
def store_reads(monkeypatch):
    """Which kernel each decode step's read of an encoded store went through ("cpu", "triton", or None: PyTorch),
    one entry per layer and step (tests/hf/test_fast_path.py, tests/gpu)."""
    from hf_kvcompress.caches import store_attention

    calls = []
    original = store_attention.attend_store

    def counted(layer, query, attention_mask, scaling, backend="auto"):
        calls.append(store_attention.store_kernel(layer, query, backend) if layer.store.n_encoded else None)
        return original(layer, query, attention_mask, scaling, backend)

    monkeypatch.setattr(store_attention, "attend_store", counted)
    monkeypatch.setattr("hf_kvcompress.caches.layer.attend_store", counted)  # what `CompressedLayer.attend` calls
    return calls
