"""Bytes at the dtype a model is served in (issue 25.7): a CPU runs the model in float32, users serve it in 16-bit.

`served_kv_bytes(cache, bfloat16)` of a cache filled by a float32 model must equal what the same plan's cache holds
when the model itself runs in bfloat16, for every family the study and the eval summaries report.
"""

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.attention import use_kvcompress_attention
from hf_kvcompress.measure import measured_kv_bytes, served_kv_bytes
from hf_kvcompress.registry import make_cache
from tests.caches.tiny_models import bytes_config

# lowrank needs a calibrated model (tests/codecs/test_lowrank.py); its bytes follow the same per-token rate
SPECS = ["dynamic", "int8", "int4", "fp8", "sink_window:sink_tokens=4,window=60", "shared_heads", "shared_heads+int8",
         "sink_window:sink_tokens=4,window=60+int4",
         "h2o:budget=64,recent=16", "snapkv:budget=64", "kvzip:ratio=0.5", "kvzip:ratio=0.25+int4",
         "kvzip:budget=64", "kvzip:ratio=0.5,budgets=token"]


def _rel(spec: str) -> float:
    """KVzip's per-head store with a lossy codec keeps its kept pairs among the context's newest (residual) slots
    at full precision: a float32 and a bfloat16 run rank a few pairs differently, so a few pairs may sit on the other
    side of that line (88 bytes each here). Every other plan's bytes do not depend on which tokens are kept."""
    return 0.03 if spec.startswith("kvzip") and "budgets=" not in spec and "+" in spec else 0


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = bytes_config()
    full = use_kvcompress_attention(LlamaForCausalLM(config).eval())
    half = use_kvcompress_attention(LlamaForCausalLM(config).eval())
    half.load_state_dict(full.state_dict())
    return full, half.to(torch.bfloat16)


@pytest.mark.parametrize("spec", SPECS)
def test_served_bytes_of_a_float32_run_are_what_a_bfloat16_run_holds(models, spec):
    full, half = models
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    caches = []
    for model in (full, half):
        cache = make_cache(spec, model.config)
        with torch.inference_mode():
            prefill(model, ids, mask, cache, repeat_prompt_ids=[5, 6, 7])
        caches.append(cache)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 300
    assert served_kv_bytes(caches[1], torch.bfloat16) == measured_kv_bytes(caches[1])
    assert served_kv_bytes(caches[0], torch.bfloat16) == pytest.approx(measured_kv_bytes(caches[1]), rel=_rel(spec))
    assert measured_kv_bytes(caches[0]) >= measured_kv_bytes(caches[1])  # fp8 holds no full-precision values


def test_a_transformers_cache_counts_its_floating_storage_at_the_served_width():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), 0)
    assert served_kv_bytes(cache, torch.bfloat16) == measured_kv_bytes(cache) // 2 == 2 * 2 * 10 * 8 * 2


@pytest.mark.parametrize("spec", ["dynamic", "int4", "kvzip:ratio=0.5+int4"])
def test_eval_batches_record_the_served_bytes_of_a_float32_run(models, spec):
    from hf_kvcompress.eval.runner import run_batch, served_name

    full, half = models
    rows = [([3 + i % 190 for i in range(200)], [7, 8, 9])]
    outs = [run_batch(model, spec, rows, 4, pad_token_id=0, repeat_prompt_ids=[5, 6]) for model in (full, half)]
    assert served_name(full) == served_name(half) == "bfloat16"  # the config declares float32: served in bf16
    assert outs[1].kv_bytes_document == outs[1].kv_bytes_document_served
    assert outs[0].kv_bytes_document_served == pytest.approx(outs[1].kv_bytes_document, rel=_rel(spec))
    assert outs[0].kv_bytes_peak_served == pytest.approx(outs[1].kv_bytes_peak_served, rel=_rel(spec))
    assert outs[0].kv_bytes_document > outs[0].kv_bytes_document_served


def test_eval_summary_compares_bytes_at_the_served_dtype_and_says_which():
    """Issue 25.7: int4 held 0.23 of the float32 cache but 0.37 of the bfloat16 one; the summary compared fp32."""
    from hf_kvcompress.eval.report import markdown, summarize

    def record(method, measured, served):
        return {"task": "needle", "method": method, "score": 100, "correct": True, "length": 1000, "depth": 50.0,
                "kv_bytes_document": measured, "kv_bytes_peak": measured, "kv_bytes_document_served": served,
                "kv_bytes_peak_served": served, "served_dtype": "bfloat16", "dtype": "float32", "tokens_kept": 10,
                "prefill_seconds": 1.0, "decode_seconds": 1.0, "protocol": "document_first", "model": "m",
                "metric": "string_match_all"}

    records = [record("dynamic", 40.0e6, 20.0e6), record("int4", 9.2e6, 7.4e6)]
    summary = summarize(records)
    int4 = next(r for r in summary["ranking"] if r["method"] == "int4")
    assert int4["memory_ratio"] == pytest.approx(0.37) and int4["kv_bytes_peak"] == 7.4e6
    text = markdown(summary, records)
    assert "at bfloat16, the dtype the model is served in (it ran in float32 here" in text
    assert "KV peak (MiB, bfloat16)" in text
    same = [dict(r, dtype="bfloat16") for r in records]
    assert "in bfloat16, the dtype the model ran in" in markdown(summarize(same), same)
