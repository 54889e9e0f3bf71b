"""The lm-eval path: model `hf-kvcompress` and the kvc_* tasks report what the runner reports on the same samples."""

import json

import pytest

from hf_kvcompress.eval import build_samples, run_eval
from hf_kvcompress.eval.scoring import metrics_dir

WINDOW = "sink_window:sink_tokens=4,window=64"


def test_lm_eval_and_the_runner_agree_on_the_same_samples(embedded, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_kvcompress.eval.lm_eval_model import KVCompressLM, register

    model, tokenizer = embedded
    samples = build_samples(tokenizer, ["needle"], [300], [0, 100])
    mine = run_eval(model, tokenizer, [WINDOW], samples=samples, out_dir=tmp_path, chunk_size=128, progress=False,
                    baseline=False)  # fmt: skip
    assert [r["method"] for r in mine] == [WINDOW, WINDOW]

    register()
    lm = KVCompressLM(pretrained=model, tokenizer=tokenizer, cache=WINDOW, chunk_size=128)
    manager = TaskManager(include_path=str(metrics_dir().parent), metadata={"data_dir": str(tmp_path)})
    out = simple_evaluate(model=lm, tasks=["kvc_needle"], task_manager=manager, log_samples=True)
    score = out["results"]["kvc_needle"]["score,none"]
    assert score == pytest.approx(sum(r["score"] for r in mine) / len(mine))
    predictions = {s["doc"]["sample_id"]: s["filtered_resps"][0] for s in out["samples"]["kvc_needle"]}
    assert predictions == {r["sample_id"]: r["prediction"] for r in mine}


def test_lm_eval_command_runs_the_registered_model(tmp_path, capsys):
    from hf_kvcompress.cli import main

    code = main([
        "lm-eval", "--model", "hf-kvcompress", "--model_args", "pretrained=,cache=int4", "--tasks", "kvc_needle",
        "--metadata", json.dumps({"lengths": [300], "depths": [50]}), "--limit", "1", "--device", "cpu",
        "--output_path", str(tmp_path / "lm"),
    ])  # fmt: skip
    assert code == 0
    written = list((tmp_path / "lm").rglob("results_*.json"))
    assert written, capsys.readouterr().out[-2000:]
    result = json.loads(written[0].read_text())["results"]["kvc_needle"]
    assert 0 <= result["score,none"] <= 100


def test_bad_cache_spec_fails_before_the_model_loads():
    from hf_kvcompress.eval.lm_eval_model import KVCompressLM

    with pytest.raises(ValueError):
        KVCompressLM(pretrained="", cache="no_such_method")


@pytest.mark.parametrize("model_args, spec", [
    ('pretrained=,cache="h2o:budget=256,recent=64"', "h2o:budget=256,recent=64"),  # the quoting the docs show
    ('{"cache": "h2o:budget=256,recent=64"}', "h2o:budget=256,recent=64"),  # lm-eval's JSON form
    ("pretrained=,cache=h2o:budget=256,recent=64", None),  # unquoted: lm-eval makes `recent=64` an argument
])
def test_a_spec_with_commas_reaches_the_model_only_quoted(monkeypatch, capsys, model_args, spec):
    """Through lm-eval's own --model_args parsing; the model stops at its spec check (no weights are loaded)."""
    from hf_kvcompress import registry
    from hf_kvcompress.cli import main

    seen = []

    def stop(text):
        seen.append(text)
        raise ValueError("stopped before the model loads")

    monkeypatch.setattr(registry, "parse_spec", stop)
    assert main(["lm-eval", "--model", "hf-kvcompress", "--model_args", model_args, "--tasks", "kvc_needle",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    if spec is not None:
        assert seen == [spec] and err.endswith("stopped before the model loads")
    else:
        assert seen == []  # refused before the spec is even read
        assert err.startswith(
            "hf-kvcompress lm-eval: error: unknown model argument recent=64 for --model hf-kvcompress"
        )
        assert "its own are pretrained, cache, query_aware, prompt_format, chunk_size, device, dtype" in err
        assert "max_length" in err  # HFLM's arguments are named too
        assert """--model_args 'pretrained=,cache="h2o:budget=256,recent=64"'""" in err


def test_loglikelihood_scores_the_continuation_from_the_cache(embedded):
    import torch
    from lm_eval.api.instance import Instance

    from hf_kvcompress.eval.lm_eval_model import KVCompressLM

    model, tokenizer = embedded
    lm = KVCompressLM(pretrained=model, tokenizer=tokenizer, cache="dynamic")
    context, continuation = "The capital of France is", " Paris, a city on the Seine."
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    [(logprob, greedy)] = lm.loglikelihood([request], disable_tqdm=True)
    context_ids, continuation_ids = lm._encode_pair(context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(context_ids) - 1 : -1].float().log_softmax(-1)
    expected = logits.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()
    assert logprob == pytest.approx(expected, abs=1e-3)
    assert greedy == bool((logits.argmax(-1) == torch.tensor(continuation_ids)).all())
