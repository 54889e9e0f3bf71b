"""RULER's string_match_part: 100 if any reference string is found in the prediction (case-insensitive), else 0.

Used for question answering, where any one of the annotators' answers counts (RULER, arXiv:2404.06654,
eval/synthetic/constants.py). Load it with `evaluate.load("eval_tasks/metrics/string_match_part.py")`.
"""

import datasets
import evaluate

_DESCRIPTION = "100 if any reference string occurs in the prediction (case-insensitive), else 0; averaged."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of list of str): for each prediction, the acceptable answers.
Returns:
    string_match_part (float): the mean score, 0 to 100, rounded to 2 decimals as RULER does.
    scores (list of float): each prediction's score, 0 or 100.
Examples:
    >>> metric = evaluate.load("eval_tasks/metrics/string_match_part.py")
    >>> metric.compute(predictions=["In France."], references=[["france", "Normandy"]])["scores"]
    [100.0]
"""
_CITATION = """@article{hsieh2024ruler,
title={RULER: What's the Real Context Size of Your Long-Context Language Models?},
author={Hsieh, Cheng-Ping and others}, journal={arXiv preprint arXiv:2404.06654}, year={2024}}"""


def string_match_part(prediction: str, references: list[str]) -> float:
    prediction = prediction.lower()
    return max(1.0 if r.lower() in prediction else 0.0 for r in references) * 100


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class StringMatchPart(evaluate.Metric):
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
        scores = [string_match_part(p, r) for p, r in zip(predictions, references, strict=True)]
        return {"string_match_part": round(sum(scores) / len(scores), 2) if scores else 0.0, "scores": scores}
