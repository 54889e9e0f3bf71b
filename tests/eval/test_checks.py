"""Bad sizes and inputs fail with a message before any evaluation: context, scaffolding, counts, binary documents."""

import pytest

from hf_kvcompress.eval import build_samples, runner
from hf_kvcompress.eval.data import read_user_documents


def test_lengths_beyond_the_models_context_are_refused(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=r"--lengths 9000: the model's context is 8,192 tokens"):
        runner.run_eval(model, tokenizer, [], ["needle"], [1000, 9000], [50], progress=False)
    with pytest.raises(ValueError, match="use lengths <= 8,176"):  # room for the needle's 16 answer tokens
        runner.check_context(model.config, [8190], 16)
    runner.check_context(model.config, [8176], 16)


def test_lengths_shorter_than_the_prompt_scaffolding_are_refused(tokenizer):
    with pytest.raises(ValueError, match=r"--lengths 30 is too short for task needle: .* take \d+ tokens"):
        build_samples(tokenizer, ["needle"], [30], [50])
    (sample,) = build_samples(tokenizer, ["needle"], [200], [50])
    assert sample["n_tokens"] <= 200


@pytest.mark.parametrize("kwargs,message", [
    ({"samples_per_cell": 0}, "--samples must be at least 1"),
    ({"limit": 0}, "--limit must be at least 1"),
    ({"chunk_size": 0}, "--chunk-size must be a positive"),
])  # fmt: skip
def test_counts_below_one_are_refused(embedded, kwargs, message):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=message):
        runner.run_eval(model, tokenizer, [], ["needle"], [300], [50], progress=False, **kwargs)


def test_a_bad_spec_fails_before_the_baseline_runs(embedded, tmp_path, monkeypatch):
    model, tokenizer = embedded
    monkeypatch.setattr(runner, "run_batch", lambda *a, **k: pytest.fail("evaluated before checking the specs"))
    with pytest.raises(ValueError, match="int5"):
        runner.run_eval(model, tokenizer, ["int5"], ["needle"], [300], [50], tmp_path, progress=False)
    assert not (tmp_path / "results.jsonl").exists()


def test_binary_files_are_not_documents(tmp_path):
    (tmp_path / "essay.txt").write_text("A real sentence about gardens. Another one.", encoding="utf-8")
    assert [name for name, _ in read_user_documents(tmp_path)] == ["essay.txt"]
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match=r"image.txt is not UTF-8 text"):
        read_user_documents(tmp_path)
    (tmp_path / "image.txt").unlink()
    (tmp_path / "latin1.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.md is not UTF-8 text"):
        read_user_documents(tmp_path)
    (tmp_path / "latin1.md").unlink()
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:2 is not a JSON line"):
        read_user_documents(tmp_path)
