"""The development and test halves: disjoint, covering every sample, stable as cells grow, recorded everywhere."""

import json

import pytest

from hf_kvcompress.eval import build_samples, run_eval, summarize
from hf_kvcompress.eval.lm_eval_tasks import dataset
from hf_kvcompress.eval.report import markdown
from hf_kvcompress.eval.tasks import SPLITS, check_split, sample_split, split_indices

TASKS = ["kv_retrieval", "needle", "multi_question"]


def ids(samples) -> list[str]:
    return list(samples["sample_id"])


@pytest.mark.parametrize("task", TASKS)
def test_the_halves_are_disjoint_cover_every_sample_and_say_which_they_are(tokenizer, task):
    every = build_samples(tokenizer, [task], [300], [10, 90], samples_per_cell=4, split="all")
    dev = build_samples(tokenizer, [task], [300], [10, 90], samples_per_cell=2, split="dev")
    test = build_samples(tokenizer, [task], [300], [10, 90], samples_per_cell=2, split="test")
    assert not set(ids(dev)) & set(ids(test))
    assert sorted(ids(dev) + ids(test)) == sorted(ids(every))
    assert set(dev["split"]) == {"dev"} and set(test["split"]) == {"test"}
    by_id = {row["sample_id"]: row for row in every}
    for row in [*dev, *test]:  # the same sample whichever half is asked for: a pure function of its identity
        assert row == by_id[row["sample_id"]] and row["split"] == sample_split(row["index"])


@pytest.mark.parametrize("task", TASKS)
def test_more_samples_per_cell_keep_the_earlier_ones_in_their_half(tokenizer, task):
    for split in ("dev", "test"):
        few = build_samples(tokenizer, [task], [300], [50], samples_per_cell=1, split=split)
        more = build_samples(tokenizer, [task], [300], [50], samples_per_cell=3, split=split)
        assert few.to_list() == [row for row in more if row["sample_id"] in set(ids(few))]
        assert len(more) == 3 * len(few)


def test_split_rule_and_its_check():
    assert SPLITS == ("dev", "test", "all")
    assert split_indices("dev", 3) == [0, 2, 4] and split_indices("test", 3) == [1, 3, 5]
    assert split_indices("all", 3) == [0, 1, 2]
    assert [sample_split(i) for i in range(4)] == ["dev", "test", "dev", "test"]
    for bad in ("train", "validation", "", None):
        with pytest.raises(ValueError, match="split must be one of dev, test, all"):
            check_split(bad)
    with pytest.raises(ValueError, match="split must be one of dev, test, all"):
        build_samples(None, ["needle"], [300], [50], split="train")


def test_test_is_the_default_half(tokenizer):
    default = build_samples(tokenizer, ["kv_retrieval"], [300], [50], samples_per_cell=2)
    test = build_samples(tokenizer, ["kv_retrieval"], [300], [50], samples_per_cell=2, split="test")
    assert ids(default) == ids(test)


def test_records_reports_and_lm_eval_name_the_half(tiny_lm, tokenizer, tmp_path):
    records = run_eval(tiny_lm, tokenizer, [], ["kv_retrieval"], [200], [50], tmp_path, samples_per_cell=2,
                       split="all", progress=False)  # fmt: skip
    assert [r["split"] for r in records] == ["dev", "test"]
    assert all(json.loads(line)["split"] in ("dev", "test") for line in (tmp_path / "results.jsonl").open())
    assert summarize(records)["splits"] == ["dev", "test"]
    assert "Split: dev and test" in (tmp_path / "summary.md").read_text()
    test_only = [r for r in records if r["split"] == "test"]
    assert "Split: test (the held-out half" in markdown(summarize(test_only), test_only)
    # lm-eval reads that run's samples of one half (kvc_<task>_dev sets split=dev).
    assert set(dataset("kv_retrieval", data_dir=str(tmp_path), split="dev")["test"]["split"]) == {"dev"}
    assert set(dataset("kv_retrieval", data_dir=str(tmp_path))["test"]["split"]) == {"test"}
    assert len(dataset("kv_retrieval", data_dir=str(tmp_path), split="all")["test"]) == 2


def test_the_dev_variants_of_the_lm_eval_tasks_read_the_dev_half(tiny_lm, tokenizer, tmp_path):
    from lm_eval.tasks import TaskManager

    from hf_kvcompress.eval.scoring import metrics_dir

    run_eval(tiny_lm, tokenizer, [], ["kv_retrieval"], [200], [50], tmp_path, samples_per_cell=2, split="all",
             progress=False)  # fmt: skip
    manager = TaskManager(include_path=str(metrics_dir().parent), metadata={"data_dir": str(tmp_path)})
    tasks = manager.load_task_or_group(["kvc_kv_retrieval", "kvc_kv_retrieval_dev"])
    assert {name: set(task.dataset["test"]["split"]) for name, task in tasks.items()} == {
        "kvc_kv_retrieval": {"test"}, "kvc_kv_retrieval_dev": {"dev"}}


def test_the_eval_command_refuses_another_split_naming_the_allowed_ones(capsys, tmp_path):
    from hf_kvcompress.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["eval", "--split", "train", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert "argument --split: invalid choice: 'train' (choose from 'dev', 'test', 'all')" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
