"""Sample generation: deterministic for a seed, lengths in the model's tokens, facts at the asked depth."""

import json

import pytest

from hf_kvcompress.eval import build_samples, data, encode, parse_task, render
from hf_kvcompress.eval.tasks import split_specs


def test_same_seed_gives_the_same_dataset_and_another_seed_another(tokenizer):
    args = (tokenizer, ["needle", "kv_retrieval"], [300], [0, 50])
    first, again, other = build_samples(*args, seed=3), build_samples(*args, seed=3), build_samples(*args, seed=4)
    assert first.to_list() == again.to_list()
    assert [r["document"] for r in first] != [r["document"] for r in other]
    # A sample does not depend on which other samples are built with it.
    alone = build_samples(tokenizer, ["kv_retrieval"], [300], [50], seed=3)
    assert alone[0] == next(r for r in first if r["sample_id"] == alone[0]["sample_id"])


def test_integer_depths_build_the_samples_float_depths_do(tokenizer):
    # The ids name the depth as "d50" either way; the CLI passes floats, Python callers often integers.
    as_int = build_samples(tokenizer, ["multi_needle"], [300], [50], split="dev")
    as_float = build_samples(tokenizer, ["multi_needle"], [300], [50.0], split="dev")
    assert as_int.to_list() == as_float.to_list()


@pytest.mark.parametrize("task", ["needle", "needle:kind=passkey", "multi_needle", "kv_retrieval", "doc_qa"])
def test_prompts_fill_the_length_in_model_tokens(tokenizer, task):
    samples = build_samples(tokenizer, [task], [400, 600], [50])
    for row in samples:
        document_ids, question_ids = encode(tokenizer, row)
        assert row["n_tokens"] == len(document_ids) + len(question_ids) <= row["length"]
        slack = {"kv_retrieval": 100, "doc_qa": 120}.get(task, 60)  # one more word, JSON pair or paragraph
        assert row["n_tokens"] > row["length"] - slack
        assert all(ref.lower() in row["document"].lower() for ref in row["references"])


def test_depth_places_the_needle(tokenizer):
    samples = build_samples(tokenizer, ["needle"], [500], [0, 50, 100])
    positions = [row["document"].find(row["references"][0]) / len(row["document"]) for row in samples]
    assert positions[0] < 0.05 and 0.35 < positions[1] < 0.65 and positions[2] > 0.9


def test_doc_qa_uses_real_squad_questions(tokenizer):
    row = build_samples(tokenizer, ["doc_qa"], [500], [100])[0]
    assert row["metric"] == "string_match_part"
    assert row["question"].rstrip().endswith("?") and "Document 1:" in row["document"]


def test_multi_needle_asks_one_key_among_distractors(tokenizer):
    row = build_samples(tokenizer, ["multi_needle:keys=3,values=2"], [500], [50])[0]
    assert row["document"].count("One of the special magic numbers for") == 6
    assert len(row["references"]) == 2 and row["task"] == "multi_needle:keys=3,values=2"


def test_user_documents_become_needle_and_recall_samples(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("The river rose in spring. " * 40
                                    + "Our ferry left at dawn and crossed slowly to the far bank today.")
    (tmp_path / "b.md").write_text("# Notes\n\nThe harbour master counts every boat twice before the tide turns. " * 20)
    line = json.dumps({"text": "A lantern hung above the door of the old inn by the road."})
    (tmp_path / "c.jsonl").write_text(line + "\n")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert [name for name, _ in data.read_user_documents(tmp_path)] == ["a.txt", "b.md", "c.jsonl:1"]
    samples = build_samples(tokenizer, ["user_needle", "user_recall"], [300], [50], documents=str(tmp_path))
    needle, recall = samples[0], samples[1]
    assert needle["sample_id"].startswith("user_needle@") and needle["references"][0] in needle["document"]
    assert recall["metric"] == "string_match_all" and all(ref in recall["document"] for ref in recall["references"])
    with pytest.raises(ValueError, match="--documents"):
        parse_task("user_recall")


def test_task_specs_are_checked():
    assert parse_task("needle").spec == "needle"
    assert parse_task("multi_needle:keys=2").spec == "multi_needle:keys=2"
    assert split_specs("needle,multi_needle:keys=4,values=2,kv_retrieval") == [
        "needle", "multi_needle:keys=4,values=2", "kv_retrieval"]
    with pytest.raises(ValueError, match="unknown task"):
        parse_task("haystack")
    with pytest.raises(ValueError, match="unknown parameter"):
        parse_task("needle:colour=red")
    with pytest.raises(ValueError, match="kind"):
        parse_task("needle:kind=emoji")


def test_chat_and_plain_rendering_split_at_the_end_of_the_document(tokenizer):
    row = build_samples(tokenizer, ["needle"], [300], [50])[0]
    document_text, question_text = render(tokenizer, row)
    assert document_text.startswith("<|im_start|>system") and document_text.endswith(row["document"])
    assert question_text.endswith("<|im_start|>assistant\n" + row["answer_prefix"])
    plain_document, plain_question = render(tokenizer, row, prompt_format="plain")
    assert plain_document == row["instruction"] + "\n\n" + row["document"]
    assert plain_question == "\n\n" + row["question"] + "\n" + row["answer_prefix"]
    aware_document, aware_question = render(tokenizer, row, query_aware=True)
    assert row["question"] in aware_document and aware_question == question_text


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path / "c"))
    assert data.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_KVCOMPRESS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert data.cache_dir() == tmp_path / "x" / "hf-kvcompress"


def test_the_texts_come_from_the_pinned_wheel():
    assert data.wheel_path().name == data.WHEEL_FILE
    assert len(data.essay_words()) > 500_000
    questions, paragraphs, _ = data.squad_questions()
    assert len(questions) > 5000 and all(q["answers"] for q in questions[:100])
