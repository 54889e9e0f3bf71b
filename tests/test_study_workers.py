"""The study's samples split between processes give the records one process gives, in the same order; the answer
cap holds."""

import pytest

from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.study_workers import order_records, run_plans_split

SAME = ("method", "sample_id", "prediction", "score", "kv_bytes_document", "document_tokens", "new_tokens")


def test_two_processes_give_the_records_of_one(embedded):
    model, tokenizer = embedded
    samples = build_samples(tokenizer, ["needle"], [200], [10, 50, 90], samples_per_cell=1, seed=0)
    plans = ["dynamic", "int8"]
    one = run_plans_split(model, tokenizer, plans, samples, workers=1, model_name="smollm2-135m", batch_size=2,
                          max_new_tokens=4)
    two = run_plans_split(model, tokenizer, plans, samples, workers=2, model_name="smollm2-135m", batch_size=2,
                          max_new_tokens=4)
    assert [[r[k] for k in SAME] for r in two] == [[r[k] for k in SAME] for r in one]
    assert [(r["method"], r["sample_id"]) for r in one] == [(p, s["sample_id"]) for p in plans for s in samples]
    assert max(r["new_tokens"] for r in one) <= 4 < 16 == samples[0]["max_new_tokens"]


def test_order_is_plan_then_sample():
    samples = [{"task": "needle", "sample_id": s} for s in ("a", "b", "c")]
    records = [{"method": m, "task": "needle", "sample_id": s} for s in ("c", "a") for m in ("int8", "dynamic")]
    records += [{"method": m, "task": "needle", "sample_id": "b"} for m in ("dynamic", "int8")]
    got = [(r["method"], r["sample_id"]) for r in order_records(records, ["dynamic", "int8"], samples)]
    assert got == [("dynamic", "a"), ("dynamic", "b"), ("dynamic", "c"), ("int8", "a"), ("int8", "b"), ("int8", "c")]


@pytest.mark.parametrize("workers", [0, -1, 1.5])
def test_workers_must_be_a_positive_whole_number(embedded, workers):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="workers must be a whole number >= 1"):
        run_plans_split(model, tokenizer, ["dynamic"], [], workers=workers, model_name="smollm2-135m")


def test_a_gpu_model_is_not_split_between_cpu_processes():
    class Gpu:
        device = type("D", (), {"type": "cuda"})()

    samples = [{"task": "needle", "sample_id": str(i)} for i in range(2)]
    with pytest.raises(ValueError, match="use workers=1 on a GPU"):
        run_plans_split(Gpu(), None, ["dynamic"], samples, workers=2, model_name="x")
