"""Exact match after SQuAD's normalisation, against the best of several references, x100.

The answer is the prediction's first non-empty line; both sides are lower-cased and stripped of punctuation,
articles (a, an, the) and extra whitespace, as SQuAD's official evaluation script does. A local module because
`evaluate.load("exact_match")` needs the Hugging Face Hub. Load it with
`evaluate.load("eval_tasks/metrics/exact_match.py")`.
"""

import re
import string

import datasets
import evaluate

_DESCRIPTION = "100 if the prediction's first line equals any reference after SQuAD normalisation, else 0; averaged."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of list of str): for each prediction, the acceptable answers.
Returns:
    exact_match (float): the mean score, 0 to 100, rounded to 2 decimals.
    scores (list of float): each prediction's score, 0 or 100.
Examples:
    >>> metric = evaluate.load("eval_tasks/metrics/exact_match.py")
    >>> metric.compute(predictions=["The Eiffel Tower.\\nIt is in Paris."], references=[["Eiffel Tower"]])["scores"]
    [100.0]
"""
_CITATION = """@inproceedings{rajpurkar2016squad, title={SQuAD: 100,000+ Questions for Machine Comprehension of Text},
author={Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy}, booktitle={EMNLP}, year={2016}}"""


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, references: list[str]) -> float:
    first_line = next((line for line in prediction.splitlines() if line.strip()), "")
    return 100.0 if any(normalize(first_line) == normalize(r) for r in references) else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
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
        scores = [exact_match(p, r) for p, r in zip(predictions, references, strict=True)]
        return {"exact_match": round(sum(scores) / len(scores), 2) if scores else 0.0, "scores": scores}
