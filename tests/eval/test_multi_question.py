"""multi_question: one document of a public-domain novel, a fact of another kind at each depth, each question
answered on an untouched copy of the document's compressed cache."""

import re

import pytest

from hf_kvcompress.eval import build_samples, data, encode, parse_task, run_eval, runner
from hf_kvcompress.eval.tasks import BANDS, band_of

DEPTHS = [5, 50, 95]
KVZIP = "kvzip:ratio=0.5"
WINDOW = "sink_window:sink_tokens=4,window=64"


@pytest.fixture(scope="module")
def documents(tokenizer):
    return build_samples(tokenizer, ["multi_question"], [700], DEPTHS, samples_per_cell=2, split="all")


def test_one_document_per_cell_index_with_a_question_per_depth(tokenizer, documents):
    again = build_samples(tokenizer, ["multi_question"], [700], DEPTHS, samples_per_cell=2, split="all")
    assert again.to_list() == documents.to_list()  # deterministic
    assert len(documents) == 2 * len(DEPTHS)
    for index in (0, 1):
        rows = [r for r in documents if r["index"] == index]
        assert [r["depth"] for r in rows] == DEPTHS
        assert len({r["document"] for r in rows}) == 1  # one document, asked once per fact
        assert len({r["question"] for r in rows}) == len(DEPTHS)
        references = [tuple(r["references"]) for r in rows]
        assert len(set(references)) == len(DEPTHS)
        for row in rows:
            document_ids, question_ids = encode(tokenizer, row)
            assert row["n_tokens"] == len(document_ids) + len(question_ids) <= row["length"]
            assert row["n_tokens"] > row["length"] - 60
    assert documents[0]["document"] != documents[len(DEPTHS)]["document"]


def test_each_fact_sits_in_its_band_and_is_asked_about_its_own_subject(documents):
    for row in documents:
        text = row["document"]
        subject = re.search(r"the ([A-Z][a-z]+ [a-z][a-z ]*?)(?= open| brought|\?)", row["question"]).group(1)
        sentence = next(s for s in re.split(r"(?<=[.!?\"])\s", text) if subject in s and row["references"][0] in s)
        where = 100 * text.index(sentence) / len(text)
        assert band_of(where) == band_of(row["depth"]), (row["depth"], where, sentence)
        assert abs(where - row["depth"]) < 10
        assert all(ref in sentence for ref in row["references"])
        assert text.count(subject) == 1  # no other fact names it


def test_the_facts_are_of_different_kinds(tokenizer, documents):
    kinds = parse_task("multi_question").kinds.split("+")
    assert len(kinds) == 5
    for index in (0, 1):
        prefixes = {r["answer_prefix"].split(" ")[1] for r in documents if r["index"] == index}
        assert len(prefixes) == len(DEPTHS)
    with pytest.raises(ValueError, match="kinds must be some of"):
        parse_task("multi_question:kinds=number+colour")
    only = build_samples(tokenizer, ["multi_question:kinds=date"], [500], [50], split="dev")
    assert len(only[0]["references"]) == 2 and re.fullmatch(r"1[78]\d\d", only[0]["references"][1])


def test_the_dev_and_test_documents_come_from_different_chapters(documents):
    dev_text, test_text = " ".join(data.book_words("dev")), " ".join(data.book_words("test"))
    for row in documents:
        words = row["document"].split(" ")
        probe = " ".join(words[len(words) // 3 : len(words) // 3 + 12])  # a stretch of prose between the facts
        home, other = (dev_text, test_text) if row["split"] == "dev" else (test_text, dev_text)
        assert probe in home and probe not in other


def test_bands_cover_every_depth():
    assert [band_of(d) for d in (0, 33, 34, 66, 67, 100)] == ["start", "start", "middle", "middle", "end", "end"]
    assert [name for name, _, _ in BANDS] == ["start", "middle", "end"]


@pytest.mark.parametrize("spec", ["dynamic", WINDOW, KVZIP])
def test_each_question_is_answered_from_an_untouched_copy_of_one_prefill(tiny_lm, tokenizer, documents, spec,
                                                                         monkeypatch):
    samples = documents.select(range(len(DEPTHS)))  # one document, three questions
    prefills = []
    real = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    shared = run_eval(tiny_lm, tokenizer, [spec], samples=samples, baseline=False, progress=False, chunk_size=128)
    assert len(prefills) == 1  # the document, once for all three questions
    assert [r["document_questions"] for r in shared] == [3, 3, 3]
    assert len({r["kv_bytes_document"] for r in shared}) == 1
    # Each question alone, on a fresh prefill: the same answer, so no question saw another's tokens.
    for k in (1, 2, 0):
        alone = run_eval(tiny_lm, tokenizer, [spec], samples=samples.select([k]), baseline=False, progress=False,
                         chunk_size=128)  # fmt: skip
        assert alone[0]["document_questions"] == 1
        assert alone[0]["prediction"] == shared[k]["prediction"]
        assert alone[0]["kv_bytes_document"] == shared[k]["kv_bytes_document"]


def test_summary_scores_the_task_per_band(tiny_lm, tokenizer, documents, tmp_path):
    records = run_eval(tiny_lm, tokenizer, [], samples=documents, out_dir=tmp_path, progress=False)
    assert {r["split"] for r in records} == {"dev", "test"}
    text = (tmp_path / "summary.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| method | score"))
    assert "| start | middle | end |" in header
    assert (tmp_path / "data" / "multi_question.jsonl").exists()
