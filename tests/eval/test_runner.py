"""run_eval: records, resume, reports, and the summary's baseline column and too-hard flag."""

import csv

import pytest

from hf_kvcompress.eval import runner, summarize
from hf_kvcompress.eval.report import markdown

from .conftest import count_batches

WINDOW = "sink_window:sink_tokens=4,window=64"


def test_run_writes_records_and_reports_then_resumes(embedded, small_samples, tmp_path, monkeypatch):
    model, tokenizer = embedded
    samples = small_samples.select([0, 1])
    out = tmp_path / "run"
    records = runner.run_eval(model, tokenizer, [WINDOW], samples=samples, out_dir=out, progress=False, chunk_size=128)
    # dynamic, the baseline, is added in front of the methods asked for.
    assert [(r["method"], r["sample_id"]) for r in records] == [
        (m, s) for m in ("dynamic", WINDOW) for s in samples["sample_id"]
    ]
    for record in records:
        assert record["protocol"] == "document_first" and record["prompt_format"] == "chat"
        assert 0 <= record["score"] <= 100 and isinstance(record["prediction"], str)
        assert record["kv_bytes_peak"] >= record["kv_bytes_document"] > 0
        assert record["prefill_seconds"] > 0 and record["decode_seconds"] > 0
    by_method = {r["method"]: r for r in records if r["sample_id"] == samples[0]["sample_id"]}
    assert by_method[WINDOW]["tokens_kept"] <= 68 < by_method["dynamic"]["tokens_kept"]
    assert by_method[WINDOW]["kv_bytes_document"] < by_method["dynamic"]["kv_bytes_document"]
    for name in ("results.jsonl", "summary.md", "summary.csv", "heatmap_dynamic.png", "quality_vs_memory.png",
                 f"heatmap_{WINDOW.replace(':', '_').replace(',', '_')}.png", "data/needle.jsonl"):  # fmt: skip
        assert (out / name).exists(), name
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4

    # A rerun finds every (method, sample_id) done and runs nothing.
    def refuse(*args, **kwargs):
        raise AssertionError("a finished pair ran again")

    monkeypatch.setattr(runner, "run_batch", refuse)
    again = runner.run_eval(model, tokenizer, [WINDOW], samples=samples, out_dir=out, progress=False, chunk_size=128)
    assert again == records
    assert (out / "results.jsonl").read_text().splitlines() == lines

    # An interrupted run (last record lost, a line cut short) resumes with exactly the missing pair.
    (out / "results.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    monkeypatch.undo()
    calls = count_batches(monkeypatch)
    resumed = runner.run_eval(model, tokenizer, [WINDOW], samples=samples, out_dir=out, progress=False, chunk_size=128)
    assert calls == [(WINDOW, 1)]
    volatile = set(runner.VOLATILE_FIELDS)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]  # noqa: E731
    assert strip(resumed) == strip(records)
    assert strip(runner.read_results(out)) == strip(records)  # the cut line is skipped, the new record whole


def _record(task, method, score, peak, length=1000, depth=50.0):
    return {"task": task, "method": method, "score": score, "correct": score == 100, "length": length,
            "depth": depth, "kv_bytes_document": peak, "kv_bytes_peak": peak, "tokens_kept": 10,
            "prefill_seconds": 1.0, "decode_seconds": 1.0, "protocol": "document_first", "metric": "string_match_all",
            "model": "m"}  # fmt: skip


def test_summary_puts_dynamic_beside_each_method_and_flags_too_hard_tasks(tmp_path):
    records = [
        _record("needle", "dynamic", 100, 1000), _record("needle", "dynamic", 60, 1000, depth=0.0),
        _record("needle", "int4", 40, 250), _record("needle", "int4", 60, 250, depth=0.0),
        _record("kv_retrieval", "dynamic", 20, 1000), _record("kv_retrieval", "int4", 80, 250),
    ]
    summary = summarize(records)
    assert summary["too_hard"] == {"kv_retrieval": 20}
    int4 = next(r for r in summary["rows"] if r["task"] == "needle" and r["method"] == "int4")
    assert int4["dynamic"] == 80 and int4["delta"] == -30 and int4["memory_ratio"] == 0.25
    # kv_retrieval is too hard: int4's lucky 80 there does not count in the ranking.
    assert [(r["method"], r["score"], r["tasks"]) for r in summary["ranking"]] == [("dynamic", 80, 1), ("int4", 50, 1)]
    text = markdown(summary, records)
    assert "too hard for this model" in text and "| `int4` | 50.0 | 80.0 | -30.0 |" in text
    from hf_kvcompress.eval.report import write_reports

    write_reports(records, tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert {(r["task"], r["method"], r["too_hard"]) for r in rows} >= {("kv_retrieval", "int4", "True")}
    assert (tmp_path / "heatmap_int4.png").stat().st_size > 1000


def test_retention_counts_the_samples_the_baseline_answers_that_the_method_still_answers():
    def sample(method, sample_id, correct, task="needle"):
        return {**_record(task, method, 100 if correct else 0, 1000), "sample_id": sample_id}

    records = [
        sample("dynamic", "a", True), sample("dynamic", "b", True), sample("dynamic", "c", False),
        sample("dynamic", "d", True),
        sample("int4", "a", True), sample("int4", "b", False), sample("int4", "c", True), sample("int4", "d", True),
        sample("dynamic", "e", True, "multi_question"), sample("int4", "e", False, "multi_question"),
    ]
    summary = summarize(records)
    int4 = next(r for r in summary["rows"] if r["task"] == "needle" and r["method"] == "int4")
    # "c" is answered by int4 alone: it is no sample the baseline answers, so it neither counts nor helps.
    assert (int4["retained"], int4["answered"]) == (2, 3) and int4["retention"] == 2 / 3
    dynamic = next(r for r in summary["rows"] if r["task"] == "needle" and r["method"] == "dynamic")
    assert dynamic["retention"] == 1.0
    ranked = next(r for r in summary["ranking"] if r["method"] == "int4")
    assert (ranked["retained"], ranked["answered"]) == (2, 4)  # pooled over both tasks' answered samples
    text = markdown(summary, records)
    assert "| 0.67 (2 / 3) |" in text and "| 0.50 (2 / 4) |" in text


def test_batched_run_keeps_sample_order_and_charges_each_row_its_share(embedded):
    from hf_kvcompress.eval import build_samples

    model, tokenizer = embedded
    # Pass-key questions all have the same length, so the three samples share one left-padded batch.
    samples = build_samples(tokenizer, ["needle:kind=passkey"], [300, 330, 360], [50])
    records = runner.run_eval(model, tokenizer, [], samples=samples, batch_size=4, progress=False)
    assert [r["sample_id"] for r in records] == samples["sample_id"]
    assert [r["batch_rows"] for r in records] == [3, 3, 3]
    assert len({r["kv_bytes_peak"] for r in records}) == 1


@pytest.mark.slow
def test_needle_grid_uncompressed(embedded, tmp_path):
    """The README's grid (lengths 1000-3000 x depths 0-100) with the uncompressed cache; ~5 minutes on 2 cores."""
    model, tokenizer = embedded
    records = runner.run_eval(model, tokenizer, [], ["needle"], [1000, 2000, 3000], [0, 25, 50, 75, 100],
                              tmp_path, progress=False)  # fmt: skip
    assert len(records) == 15
    assert (tmp_path / "heatmap_dynamic.png").exists()
