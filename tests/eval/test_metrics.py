"""The local evaluate metric modules on hand-made cases (RULER's formulas, SQuAD's normalisation)."""

import pytest

from hf_kvcompress.eval.scoring import clean_prediction, load_metric, score_all


def test_string_match_all_counts_the_fraction_found_case_insensitively():
    metric = load_metric("string_match_all")
    out = metric.compute(predictions=["The numbers are 12 and SEVEN."], references=[["12", "seven", "99"]])
    assert out["scores"] == pytest.approx([200 / 3])
    assert out["string_match_all"] == 66.67


def test_string_match_all_averages_over_predictions():
    out = load_metric("string_match_all").compute(predictions=["a b", "nothing"], references=[["a", "b"], ["x"]])
    assert out["scores"] == [100.0, 0.0]
    assert out["string_match_all"] == 50.0


def test_string_match_part_needs_any_reference():
    metric = load_metric("string_match_part")
    out = metric.compute(predictions=["In France.", "Rollo", ""],
                         references=[["france", "Normandy"], ["Norway"], ["x"]])
    assert out["scores"] == [100.0, 0.0, 0.0]
    assert out["string_match_part"] == 33.33


def test_exact_match_normalises_like_squad_and_reads_the_first_line():
    metric = load_metric("exact_match")
    predictions = ["The Eiffel Tower.\nIt is in Paris.", "  \n the 10th century", "Eiffel Tower in Paris"]
    references = [["Eiffel Tower"], ["10th century", "tenth"], ["Eiffel Tower"]]
    assert metric.compute(predictions=predictions, references=references)["scores"] == [100.0, 100.0, 0.0]


def test_score_all_cleans_control_characters_and_returns_every_metric():
    scores = score_all(["\x00 1234567.\t"], [["1234567"]])
    assert set(scores) == {"string_match_all", "string_match_part", "exact_match"}
    assert scores["string_match_all"] == [100.0] and scores["exact_match"] == [100.0]
    assert clean_prediction("\x01abc\x02 ") == "abc"


def test_unknown_metric_is_refused():
    with pytest.raises(ValueError, match="unknown metric"):
        load_metric("bleu")
