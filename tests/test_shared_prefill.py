"""The study's shared prefill: a plan's cache rebuilt from one DynamicCache prefill answers exactly as a cache that
was given the document itself (one chunk), for every family of non-attention plans."""

import pytest
import torch

from hf_kvcompress.eval.runner import run_batch
from hf_kvcompress.eval.runner import left_pad
from hf_kvcompress.shared_prefill import document_states, replay
from hf_kvcompress.generation import generate
from hf_kvcompress.measure import measured_kv_bytes

from .caches.tiny_models import tiny_model

PLANS = ["dynamic", "int4:group_size=16,residual_length=4", "fp8", "sink_window:sink_tokens=2,window=8",
         "shared_heads", "sink_window:sink_tokens=2,window=8+shared_heads+int8:group_size=16,residual_length=2"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_replayed_caches_answer_as_a_real_prefill(family):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 128, (n,), generator=g).tolist(), torch.randint(3, 128, (4,), generator=g).tolist())
            for n in (20, 17)]
    full_ids, full_mask, width = left_pad(rows, 0)
    reference = document_states(model, full_ids, full_mask, width)
    for plan in PLANS:
        if family == "gemma3" and "shared_heads" in plan:
            continue  # one KV head: refused (tested in tests/caches/test_shared_heads_cache.py)
        real = run_batch(model, plan, rows, 6, pad_token_id=0, chunk_size=None)
        cache = replay(plan, model, reference, full_mask[:, :width])
        assert measured_kv_bytes(cache) == real.kv_bytes_document, plan
        got = generate(model, full_ids, full_mask, cache, max_new_tokens=6).new_tokens.tolist()
        assert got == real.new_tokens, plan

