"""The study's statistics: Wilson and bootstrap intervals, retention, and a recommendation that admits ties."""

import math

import pytest

from hf_kvcompress import study
from hf_kvcompress.models import load_config


def test_wilson_matches_the_textbook_values():
    lo, hi = study.wilson(15, 30)
    assert lo == pytest.approx(33.2, abs=0.1) and hi == pytest.approx(66.8, abs=0.1)
    lo, hi = study.wilson(30, 30)
    assert hi == 100 and lo == pytest.approx(88.6, abs=0.1)
    assert all(math.isnan(v) for v in study.wilson(0, 0))


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_samples():
    few = study.bootstrap_mean([0, 100, 50, 100, 0, 100])
    many = study.bootstrap_mean([0, 100, 50, 100, 0, 100] * 10)
    assert few[0] < 58.4 < few[1] and many[0] < 58.4 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


def _records(method, scores, depth=50):
    return [{"method": method, "sample_id": str(i), "task": "needle", "depth": depth, "score": s,
             "correct": s >= 100, "kv_bytes_document": 1000.0 if method == "dynamic" else 250.0,
             "document_tokens": 2000} for i, s in enumerate(scores)]


def test_retention_and_a_tie_are_reported():
    config = load_config()
    base = [100] * 28 + [0, 0]
    records = (_records("dynamic", base) + _records("int8", [100] * 27 + [0, 0, 100])
               + _records("sink_window:sink_tokens=4,window=496", [0] * 30))
    results = study.analyse(records, config, 2, 0.25 * 2**30, 80 * 2**30, 8000)
    by = {r.spec: r for r in results}
    assert by["int8"].retention == pytest.approx(100 * 27 / 28)
    assert by["sink_window:sink_tokens=4,window=496"].retention == 0
    assert by["dynamic"].band_ci["middle"][0] < by["dynamic"].bands["middle"] < by["dynamic"].band_ci["middle"][1]
    best = study.recommend(results, 10)
    assert best.spec == "int8"
    text = study.recommendation_text(best, results)
    assert "cannot be told apart from the uncompressed cache" in text and "dynamic (" in text
    assert "sink_window" not in text.split("Cannot be told apart")[1]
    table = study.format_table(results, 2000)
    assert "retention" in table and "[" in table


def test_formula_counts_sharing_and_low_rank():
    config = load_config()  # SmolLM2: 3 KV heads, head_dim 64, fp32
    full = study.formula_bytes("dynamic", config, 1000, 4)
    assert study.formula_bytes("shared_heads", config, 1000, 4) == pytest.approx(full / 3)
    assert study.formula_bytes("lowrank:rank=16", config, 1000, 4) == pytest.approx(full / 4)
    assert study.formula_bytes("shared_heads+int8", config, 1000, 4) == pytest.approx(full / 3 / 4)
    assert study.family("sink_window:window=64+shared_heads+int8") == "eviction + sharing + quantization"
    # calibrated maps store round(0.67 x 180) of 30 layers x 2 kinds x 3 KV heads (not all 3 heads into 1)
    assert study.formula_bytes("shared_heads:ratio=0.67", config, 1000, 4) == pytest.approx(full * 121 / 180)
    assert study.bytes_per_value("shared_heads:ratio=0.67", 4) == pytest.approx(4 * 0.67)  # no config: the ratio
    assert study.formula_bytes("lowrank:ratio=0.5+int4", config, 1000, 4) == pytest.approx(full / 2 / 8)


@pytest.mark.parametrize("spec", ["shared_heads", "shared_heads+int8", "lowrank", "lowrank:rank=32+int4",
                                  "sink_window:window=64+shared_heads+int8", "shared_heads:ratio=0.67",
                                  "lowrank:ratio=0.5", "lowrank:ratio=0.5+int4"])
def test_analytic_bytes_of_sharing_and_low_rank_equal_a_real_caches_promise(embedded, spec):
    import torch

    from hf_kvcompress import make_cache, measured_kv_bytes
    from hf_kvcompress.study import promised_bytes

    model, _ = embedded
    ids = torch.randint(10, 1000, (1, 240), generator=torch.Generator().manual_seed(0))
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    bookkeeping = model.config.num_hidden_layers * 2 * 8
    assert promised_bytes(spec, model.config, 240, 4) == pytest.approx(cache.promised_kv_bytes() - bookkeeping)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
