"""RULER's string_match_all: the fraction of reference strings found in the prediction, case-insensitive, x100.

Used for the needle tasks, where every value asked for must be recalled (RULER, arXiv:2404.06654,
eval/synthetic/constants.py). Load it with `evaluate.load("eval_tasks/metrics/string_match_all.py")`.
"""

import datasets
import evaluate

_DESCRIPTION = "Fraction of the reference strings that occur in the prediction (case-insensitive), times 100."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of list of str): for each prediction, the strings that should all occur in it.
Returns:
    string_match_all (float): the mean score, 0 to 100, rounded to 2 decimals as RULER does.
    scores (list of float): each prediction's score, 0 to 100.
Examples:
    >>> metric = evaluate.load("eval_tasks/metrics/string_match_all.py")
    >>> metric.compute(predictions=["The numbers are 12 and 7"], references=[["12", "7", "99"]])["scores"]
    [66.66666666666666]
"""
_CITATION = """@article{hsieh2024ruler,
title={RULER: What's the Real Context Size of Your Long-Context Language Models?},
author={Hsieh, Cheng-Ping and others}, journal={arXiv preprint arXiv:2404.06654}, year={2024}}"""


def string_match_all(prediction: str, references: list[str]) -> float:
    prediction = prediction.lower()
    return sum(1.0 if r.lower() in prediction else 0.0 for r in references) / len(references) * 100


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class StringMatchAll(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references):
        scores = [string_match_all(p, r) for p, r in zip(predictions, references, strict=True)]
        return {"string_match_all": round(sum(scores) / len(scores), 2) if scores else 0.0, "scores": scores}
