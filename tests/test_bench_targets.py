"""benchmarks/harness/bench_targets.py: the speed targets (issues 29 and 30) read from a bench run's rows (met, not
met, failed, not measured), and bench.py's `--targets` grid running exactly the runs they read."""

import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent.parent / "benchmarks" / "harness"
sys.path.insert(0, str(HARNESS))

import bench  # noqa: E402
import bench_targets  # noqa: E402
from bench_targets import TARGETS, Target, assess, targets_table  # noqa: E402

SNAPKV, KVZIP, SINK = "snapkv:ratio=0.25", "kvzip:ratio=0.25", "sink_window:sink_tokens=4,window=1020"
LOWRANK_HALF = "lowrank:ratio=0.5"


def _run(decode_ms: float, prefill_s: float = 10.0) -> dict:
    return {"prefill_s": prefill_s, "decode_ms": decode_ms, "decode_peak": 1, "prefill_peak": 1, "kv_bytes": 1,
            "kept": 1}


def _row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {start}"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def _target(spec: str, tokens: int) -> Target:
    return next(t for t in TARGETS if t.specs == (spec,) and t.tokens == (tokens,))


def test_each_target_cell_is_met_not_met_failed_or_not_measured():
    results = {
        ("float32", "dynamic", 4096, 1): [_run(100.0), _run(100.0)],
        ("float32", "int4", 4096, 1): [_run(90.0), _run(110.0)],  # median 100: 1.00x, at the limit
        ("float32", "int2", 4096, 1): [_run(101.0), _run(103.0)],  # 1.02x
        ("float32", "fp8", 4096, 1): [{"error": "RuntimeError: boom (exit 1)"}],
        ("bfloat16", "dynamic", 4096, 1): [{"error": "killed (exit -9)"}],
        ("bfloat16", "int4", 4096, 1): [_run(50.0)],
    }
    ours = ["dynamic", "int4", "int2", "fp8"]
    assert assess(_target("int4", 4096), results, ours, "float32", 1) == (1.0, "met", "`int4` at 4k")
    ratio, status, _ = assess(_target("int2", 4096), results, ours, "float32", 1)
    assert status == "not met" and ratio == pytest.approx(1.02)
    results[("float32", "int4", 1024, 1)] = [_run(115.3)]
    results[("float32", "int2", 1024, 1)] = [_run(115.6)]
    results[("float32", "dynamic", 1024, 1)] = [_run(100.0)]
    assert assess(_target("int4", 1024), results, ours, "float32", 1)[1] == "met"  # 1.15x as shown
    assert assess(_target("int2", 1024), results, ours, "float32", 1)[1] == "not met"  # 1.16x
    assert assess(_target("fp8", 4096), results, ours, "float32", 1) == (None, "failed", "`fp8` at 4k")
    assert assess(_target("int4", 4096), results, ours, "bfloat16", 1) == (
        None, "failed", "`int4` at 4k (its DynamicCache)")
    assert assess(_target("int4", 4096), results, ours, "float32", 8)[1] == "not measured"
    assert assess(_target("int4", 8192), results, ours, "float32", 1)[1] == "not measured"
    assert assess(_target("int8", 4096), results, ours, "float32", 1)[1] == "not measured"

    text = targets_table(results, ours)
    header = text.splitlines()[0]
    assert header == ("| target | float32, batch 1 | float32, batch 8 | bfloat16, batch 1 | bfloat16, batch 8 |")
    assert _row(text, "decode of `int4` at 4k <= 1x") == ["1.00x met", "not measured", "failed", "not measured"]
    assert _row(text, "decode of `int2` at 4k <= 1x") == ["1.02x **not met**", "not measured", "not measured",
                                                          "not measured"]
    assert _row(text, "decode of `fp8` at 4k <= 1x")[0] == "failed"
    assert _row(text, "decode of `int4` at 1k <= 1.15x")[0] == "1.15x met"
    assert len(text.splitlines()) == 2 + len(TARGETS) + 2
    # 13 targets x 4 columns; the prefill target fails in float32 (fp8) and bfloat16 (DynamicCache) at batch 1
    assert len(TARGETS) == 13
    assert _row(text, "prefill of every cache but kvzip <= 1.1x") == [
        "1.00x failed (`fp8` at 4k)", "not measured", "failed (`int4` at 4k (its DynamicCache))", "not measured"]
    assert text.splitlines()[-1] == "Of 52 target cells: 2 met, 2 not met, 4 failed, 44 not measured."


def test_prefill_reads_the_worst_of_every_cache_of_ours_but_kvzip_and_no_peer_or_earlier_checkout():
    prefill = next(t for t in TARGETS if t.key == "prefill_s")
    results = {("float32", label, n, 1): [_run(50.0, seconds)] for label, n, seconds in [
        ("dynamic", 1024, 2.0), ("dynamic", 8192, 40.0),
        ("int4", 1024, 2.1), ("int4", 8192, 42.0),  # 1.05x, 1.05x
        (SINK, 8192, 43.6),  # 1.09x: the worst that counts
        (KVZIP, 8192, 180.0),  # 4.5x: KVzip reads the prompt twice, not a target
        ("kvzip:ratio=0.25,span=0+int4", 8192, 180.0),
        ("int4 @/tmp/before", 8192, 60.0),  # an earlier checkout (--compare-code)
        ("dynamic@kvpress", 8192, 10.0), ("kvpress-snapkv", 8192, 30.0),  # a peer, against its own DynamicCache
    ]}
    ours = ["dynamic", "int4", SINK, KVZIP, "kvzip:ratio=0.25,span=0+int4"]
    ratio, status, where = assess(prefill, results, ours, "float32", 1)
    assert (round(ratio, 2), status, where) == (1.09, "met", f"`{SINK}` at 8k")
    assert _row(targets_table(results, ours), "prefill of every cache but kvzip <= 1.1x")[0] == (
        f"1.09x met (`{SINK}` at 8k)")

    results[("float32", "int4", 1024, 1)] = [_run(50.0, 2.4)]  # 1.2x at 1k
    assert assess(prefill, results, ours, "float32", 1)[:2] == (pytest.approx(1.2), "not met")
    results[("float32", "int2", 1024, 1)] = [{"error": "ValueError: x (exit 1)"}]
    assert assess(prefill, results, ours + ["int2"], "float32", 1)[1:] == ("failed", "`int2` at 1k")


def test_the_targets_grid_is_exactly_the_runs_the_targets_read():
    assert bench_targets.CELLS == sorted(
        [("dynamic", n) for n in (1024, 4096, 8192)] + [(s, n) for s in ("int4", "int2") for n in (1024, 4096, 8192)]
        + [(s, 4096) for s in ("fp8", "int8", SNAPKV, KVZIP, LOWRANK_HALF, "lowrank")] + [(SINK, 8192)])
    # `make bench`'s default caches include every cache a target names, so its table reports each of them
    assert {s for t in TARGETS for s in t.specs} <= set(bench.SPECS)


def test_measure_runs_only_the_planned_cells_and_the_table_shows_only_those():
    rows = bench.plan_rows(["dynamic", "int4", SINK], ["quanto-int4"])
    grid = [(1024, 1), (8192, 1)]
    ran = []

    def run(row, length, batch):
        ran.append((row.label, length))
        return _run(10.0)

    only = {("dynamic", 1024), ("dynamic", 8192), ("int4", 1024), (SINK, 8192)}
    results = bench.measure(rows, grid, 2, run, {}, only)
    peers = [(label, n) for label in ("dynamic@quantized", "quanto-int4") for n in (1024, 8192)]
    assert sorted(ran) == sorted(2 * (sorted(only) + peers))
    text = bench.table(results, rows, grid)
    assert "| 1024 | 1 | `int4` |" in text and "| 8192 | 1 | `int4` |" not in text
    assert f"| 8192 | 1 | `{SINK}` |" in text and f"| 1024 | 1 | `{SINK}` |" not in text


def test_the_bench_prints_the_targets_after_its_tables(monkeypatch, tmp_path, capsys):
    def fake(args, row, length, batch):
        slow = {"int4": 0.55, "int2": 0.7, SINK: 0.45, SNAPKV: 0.45, KVZIP: 0.45}.get(row.label, 0.9)
        return _run(100.0 * (slow if row.label != "dynamic" else 1.0)) | {"versions": {}}

    monkeypatch.setattr(bench, "_run_worker", fake)
    monkeypatch.setattr(bench, "build_kernels", lambda rows: None)
    monkeypatch.setattr(bench, "plot", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--targets", "--batches", "1", "--dtypes", "float32", "--repeats",
                                      "1", "--out", str(tmp_path)])
    bench.main()
    printed = capsys.readouterr().out
    written = next(tmp_path.glob("bench-*.md")).read_text()
    assert "### Speed targets (issues 29 and 30)" in written and "### Speed targets (issues 29 and 30)" in printed
    assert _row(written, "decode of `int4` at 8k <= 0.6x")[0] == "0.55x met"
    assert _row(written, "decode of `int2` at 4k <= 1x")[0] == "0.70x met"
    assert _row(written, "decode of `int2` at 8k <= 0.6x")[0] == "0.70x **not met**"
    # every DynamicCache here decodes at 100 ms, so a 1k one is as slow as the 8k one: the floor is 1x
    assert _row(written, f"decode of `{SINK}` at 8k <= 0.4x")[0] == (
        "0.45x **not met** (floor 1.00x: DynamicCache of 1k tokens; the target is below it)")
    assert _row(written, "prefill of every cache but kvzip <= 1.1x")[:2] == ["1.00x met (`int2` at 1k)",
                                                                              "not measured"]
    # every target is measured at float32 batch 1, nothing else
    assert written.splitlines()[-1] == "Of 52 target cells: 11 met, 2 not met, 0 failed, 39 not measured."
    assert "| 8192 | 1 | `fp8` |" not in written and "| 4096 | 1 | `fp8` |" in written


@pytest.mark.parametrize("other", [["--quick"], ["--full"], ["--specs", "int4"]])
def test_targets_choose_their_own_runs(monkeypatch, other):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--targets", *other])
    with pytest.raises(SystemExit):
        bench.main()


def test_an_eviction_target_not_met_names_the_floor_of_a_dynamic_cache_of_its_kept_tokens():
    results = {
        ("float32", "dynamic", 1024, 1): [_run(71.0)],
        ("float32", "dynamic", 4096, 1): [_run(100.0)],
        ("float32", SNAPKV, 4096, 1): [_run(74.0)],  # 0.74x, above the 0.5x target; the floor 0.71x is too
        ("float32", KVZIP, 4096, 1): [_run(45.0)],  # met: no floor shown
        ("bfloat16", "dynamic", 4096, 1): [_run(100.0)],
        ("bfloat16", SNAPKV, 4096, 1): [_run(60.0)],  # not met, no 1k DynamicCache in bf16: no floor
        ("float32", "int4", 4096, 1): [_run(120.0)],  # not met, not an eviction target: no floor
    }
    ours = ["dynamic", SNAPKV, KVZIP, "int4"]
    assert bench_targets.floor(_target(SNAPKV, 4096), results, "float32", 1) == pytest.approx(0.71)
    assert bench_targets.floor(_target(SNAPKV, 4096), results, "bfloat16", 1) is None
    assert bench_targets.floor(_target("int4", 4096), results, "float32", 1) is None
    text = targets_table(results, ours)
    assert _row(text, f"decode of `{SNAPKV}` at 4k <= 0.5x")[0] == (
        "0.74x **not met** (floor 0.71x: DynamicCache of 1k tokens; the target is below it)")
    assert _row(text, f"decode of `{SNAPKV}` at 4k <= 0.5x")[2] == "0.60x **not met**"
    assert _row(text, f"decode of `{KVZIP}` at 4k <= 0.5x")[0] == "0.45x met"
    assert _row(text, "decode of `int4` at 4k <= 1x")[0] == "1.20x **not met**"
    results[("float32", "dynamic", 1024, 1)] = [_run(40.0)]  # a floor under the target: no "below it"
    assert _row(targets_table(results, ours), f"decode of `{SNAPKV}` at 4k <= 0.5x")[0] == (
        "0.74x **not met** (floor 0.40x: DynamicCache of 1k tokens)")


def test_the_low_rank_target_reads_the_worse_of_its_two_caches():
    target = next(t for t in TARGETS if t.specs == (LOWRANK_HALF, "lowrank"))
    results = {
        ("float32", "dynamic", 4096, 1): [_run(100.0)],
        ("float32", LOWRANK_HALF, 4096, 1): [_run(126.0)],
        ("float32", "lowrank", 4096, 1): [_run(114.0)],
        ("bfloat16", "dynamic", 4096, 1): [_run(200.0)],
        ("bfloat16", LOWRANK_HALF, 4096, 1): [_run(120.0)],
    }
    ours = ["dynamic", LOWRANK_HALF, "lowrank"]
    ratio, status, where = assess(target, results, ours, "float32", 1)
    assert (round(ratio, 2), status, where) == (1.26, "not met", f"`{LOWRANK_HALF}` at 4k")
    assert assess(target, results, ours, "bfloat16", 1)[:2] == (pytest.approx(0.6), "met")  # the run it has
    row = _row(targets_table(results, ours), f"decode of `{LOWRANK_HALF}` and `lowrank` at 4k <= 1.2x")
    assert row[0] == f"1.26x **not met** (`{LOWRANK_HALF}` at 4k)"  # no floor: not an eviction target
    results[("float32", LOWRANK_HALF, 4096, 1)] = [_run(119.0)]
    assert assess(target, results, ours, "float32", 1) == (pytest.approx(1.19), "met", f"`{LOWRANK_HALF}` at 4k")
