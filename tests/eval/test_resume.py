"""Resume reuses a stored result only when every setting matches, and an interrupted run keeps what it finished."""

import json

import pytest

from hf_kvcompress.eval import runner
from hf_kvcompress.eval.report import slug

from .conftest import count_batches

WINDOW = "sink_window:sink_tokens=4,window=64"


@pytest.fixture
def counted(monkeypatch):
    """The (method, rows) of every batch run_batch evaluates from now on."""
    return count_batches(monkeypatch)


def test_every_setting_is_recorded_and_a_changed_one_reruns_its_pairs(embedded, small_samples, tmp_path, counted):
    model, tokenizer = embedded
    samples = small_samples.select([0])
    out = tmp_path / "run"
    run = lambda **kw: runner.run_eval(model, tokenizer, [WINDOW], samples=samples, out_dir=out, progress=False, **kw)  # noqa: E731
    first = run(chunk_size=128)
    for record in first:
        assert set(runner.SETTING_FIELDS) <= set(record)
        assert record["dtype"] == "float32" and record["device"] == "cpu" and record["version"] != "unknown"
        assert record["max_new_tokens"] == 16 and record["process_index"] == 0
    assert {r["method"]: r["chunk_size"] for r in first} == {"dynamic": None, WINDOW: 128}
    counted.clear()

    # Another chunk size changes what the bounded-memory method computes, not the uncompressed one.
    run(chunk_size=64)
    assert counted == [(WINDOW, 1)]
    counted.clear()
    run(chunk_size=64)
    assert counted == []

    # A stored record made with another dtype (or model, or package version) is not reused.
    lines = (out / "results.jsonl").read_text().splitlines()
    edited = [json.loads(line) for line in lines]
    for record in edited:
        if record["method"] == "dynamic":
            record["dtype"] = "bfloat16"
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    again = run(chunk_size=64)
    assert counted == [("dynamic", 1)]
    assert [r["dtype"] for r in again] == ["float32", "float32"]


def test_a_longer_answer_or_other_sample_text_is_a_different_setting(embedded, small_samples, tmp_path, counted):
    model, tokenizer = embedded
    samples = small_samples.select([0])
    out = tmp_path / "run"
    runner.run_eval(model, tokenizer, [], samples=samples, out_dir=out, progress=False)
    counted.clear()
    longer = samples.map(lambda row: {"max_new_tokens": 20})
    runner.run_eval(model, tokenizer, [], samples=longer, out_dir=out, progress=False)
    assert counted == [("dynamic", 1)]
    counted.clear()
    other = samples.map(lambda row: {"document": row["document"].replace(" the ", " a ", 1)})
    runner.run_eval(model, tokenizer, [], samples=other, out_dir=out, progress=False)
    assert counted == [("dynamic", 1)]


def test_interrupted_run_keeps_finished_batches_and_the_rerun_says_what_was_done(embedded, small_samples, tmp_path,
                                                                                 monkeypatch, capsys):  # fmt: skip
    model, tokenizer = embedded
    samples = small_samples.select([0, 1])
    out = tmp_path / "run"
    real = runner.run_batch
    calls = []

    def stop_at_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_batch", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        runner.run_eval(model, tokenizer, [], samples=samples, out_dir=out, progress=False)
    assert len(runner.read_results(out)) == 1
    monkeypatch.setattr(runner, "run_batch", real)
    counts = {}
    runner.run_eval(model, tokenizer, [], samples=samples, out_dir=out, progress=True, counts=counts)
    assert counts == {"reused": 1, "to_run": 1}
    assert "1 done before" in capsys.readouterr().err
    runner.run_eval(model, tokenizer, [], samples=samples, out_dir=out, progress=True, counts=counts)
    err = capsys.readouterr().err
    assert counts == {"reused": 2, "to_run": 0}
    assert "all 2 results are already in" in err and "0sample" not in err


def test_a_changed_meaning_of_the_spec_reruns_its_pairs(embedded, small_samples, tmp_path, counted, monkeypatch):
    """`int4` settles its rotation per model family: when that changes without a version bump, its stored records
    are not reused; nor are records written before the resolved digest was recorded (they cannot show theirs)."""
    from hf_kvcompress.codecs import intn

    model, tokenizer = embedded
    samples = small_samples.select([0])
    out = tmp_path / "run"
    run = lambda: runner.run_eval(model, tokenizer, ["int4"], samples=samples, out_dir=out, progress=False)  # noqa: E731
    run()
    counted.clear()
    monkeypatch.setitem(intn.ROTATION_BY_MODEL_TYPE, model.config.model_type, "per_token")
    run()
    assert counted == [("int4", 1)]
    counted.clear()
    run()
    assert counted == []

    stored = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for record in stored:
        del record["resolved_digest"]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stored))
    run()
    assert sorted(counted) == [("dynamic", 1), ("int4", 1)]


def test_a_rerun_with_fewer_methods_keeps_the_folders_other_methods_in_the_summary(embedded, small_samples, tmp_path,
                                                                                   counted):
    model, tokenizer = embedded
    samples = small_samples.select([0])
    out = tmp_path / "run"
    runner.run_eval(model, tokenizer, [WINDOW, "int4"], samples=samples, out_dir=out, progress=False)
    counted.clear()
    records = runner.run_eval(model, tokenizer, ["int4"], samples=samples, out_dir=out, progress=False)
    assert counted == [] and [r["method"] for r in records] == ["dynamic", "int4"]  # returns this run's methods
    summary = (out / "summary.md").read_text()
    assert f"`{WINDOW}`" in summary and "`int4`" in summary and "3 results" in summary
    assert (out / f"heatmap_{slug(WINDOW)}.png").exists()
    assert "not summarized" not in summary

    # A method whose records were made with other settings is named, not mixed into the tables.
    edited = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for record in edited:
        if record["method"] == WINDOW:
            record["dtype"] = "bfloat16"
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    runner.run_eval(model, tokenizer, ["int4"], samples=samples, out_dir=out, progress=False)
    summary = (out / "summary.md").read_text()
    assert "2 results" in summary and f"not summarized: `{WINDOW}`." in summary
