"""The lesson's budget table beside the study's measured quality: every lesson row finds its plan, or says none."""

import pytest

from hf_kvcompress import study
from hf_kvcompress.lesson_table import LESSON_ROWS, format_lesson_table, lesson_rows
from hf_kvcompress.models import load_config


def _records(method, scores, kv_bytes=1000.0):
    return [{"method": method, "sample_id": str(i), "task": "needle", "depth": 50, "score": s, "correct": s >= 100,
             "kv_bytes_document": kv_bytes, "document_tokens": 2000} for i, s in enumerate(scores)]


PLANS = ["dynamic", "int8", "int4", "fp8", "sink_window:sink_tokens=4,window=508", "kvzip:ratio=0.25",
         "kvzap:ratio=0.25", "shared_heads:ratio=0.67", "lowrank:ratio=0.5", "lowrank:ratio=0.5+int4",
         "sink_window:sink_tokens=4,window=508+int4"]


def test_each_lesson_row_shows_its_familys_study_plan_beside_the_formula():
    config = load_config()  # SmolLM2: 30 layers, 3 KV heads, head_dim 64
    records = [r for i, p in enumerate(PLANS) for r in _records(p, [100] * (30 - i) + [0] * i)]
    results = study.analyse(records, config, 2, 0.25 * 2**30, 80 * 2**30, 8000)
    rows = lesson_rows(results, config, 2000, 4)
    assert [row.lesson for row in rows] == [name for name, _ in LESSON_ROWS]
    # sinks + window (5th plan: 5 of 30 lost) scores above KVzip (6th), so it stands for eviction here
    assert [row.result.spec for row in rows] == ["int8", "int4", "sink_window:sink_tokens=4,window=508",
                                                 "shared_heads:ratio=0.67", "lowrank:ratio=0.5",
                                                 "lowrank:ratio=0.5+int4"]
    factors = {row.lesson: row.formula_factor for row in rows}
    assert factors["share heads: GQA 8 KV"] == pytest.approx(180 / 121)  # round(0.67 x 180) of 180 heads stored
    assert factors["low-rank: 128 -> 32 dims"] == pytest.approx(2)  # half of all key and value dimensions
    assert factors["GQA 8 + INT8 combined"] == pytest.approx(16)  # fp32 -> half a byte, half the dimensions
    assert factors["evict: keep 4k tokens"] == pytest.approx(2000 / 512)
    assert [row.lesson_factor for row in rows] == [2, 4, 8, 4, 4, 8]
    text = format_lesson_table(rows, next(r for r in results if r.spec == "dynamic"))
    lowrank = next(line for line in text.splitlines() if line.startswith("low-rank"))
    assert "lowrank:ratio=0.5 " in lowrank and f"{100 * 22 / 30:5.0f} [" in lowrank  # 9th plan: 8 of 30 lost
    assert text.splitlines()[1].startswith("baseline FP16")


def test_a_family_with_several_plans_shows_its_best_measured_one():
    config = load_config()
    plans = {"dynamic": (0, 1000), "kvzip:ratio=0.25": (0, 250), "sink_window:sink_tokens=4,window=508": (20, 250),
             "lowrank:ratio=0.5+int8": (3, 300), "lowrank:ratio=0.5+int4": (3, 200),
             "shared_heads:ratio=0.67": (3, 700), "shared_heads": (30, 330)}
    records = [r for p, (lost, kv) in plans.items() for r in _records(p, [100] * (30 - lost) + [0] * lost, kv)]
    results = study.analyse(records, config, 2, 0.25 * 2**30, 80 * 2**30, 8000)
    rows = {row.lesson: row.result.spec for row in lesson_rows(results, config, 2000, 4) if row.result}
    assert rows["evict: keep 4k tokens"] == "kvzip:ratio=0.25"  # the higher score at the same bytes
    assert rows["share heads: GQA 8 KV"] == "shared_heads:ratio=0.67"  # group means answered none
    assert rows["GQA 8 + INT8 combined"] == "lowrank:ratio=0.5+int4"  # the same score: the fewer measured bytes


def test_a_family_the_study_did_not_run_is_said_so():
    config = load_config()
    records = _records("dynamic", [100] * 10) + _records("int8", [100] * 10)
    results = study.analyse(records, config, 2, 0.25 * 2**30, 80 * 2**30, 8000)
    rows = lesson_rows(results, config, 2000, 4)
    assert [row.result is not None for row in rows] == [True, False, False, False, False, False]
    text = format_lesson_table(rows, results[0])
    assert text.count("(no plan of this family in the study)") == 5


def test_the_table_read_back_from_study_json_prints_as_written(tmp_path):
    config = load_config()
    records = [r for i, p in enumerate(PLANS) for r in _records(p, [100] * (30 - 2 * i) + [0] * (2 * i))]
    results = study.analyse(records, config, 2, 0.25 * 2**30, 80 * 2**30, 8000)
    rows = lesson_rows(results, config, 2000, 4)
    path = study.write_results(results, rows, tmp_path / "study.json", model="smollm2-135m", tokens=2000)
    about, again, rows_again = study.read_results(path)
    assert about == {"model": "smollm2-135m", "tokens": 2000}
    assert [r.spec for r in again] == PLANS
    base = next(r for r in results if r.spec == "dynamic")
    assert format_lesson_table(rows_again, again[0]) == format_lesson_table(rows, base)
