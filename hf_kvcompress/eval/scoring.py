"""Score predictions with the local `evaluate` metric modules in eval_tasks/metrics/ (the Hub is never used)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

METRICS = ("string_match_all", "string_match_part", "exact_match")


def metrics_dir() -> Path:
    """eval_tasks/metrics/: in a checkout and in an installed wheel alike, `eval_tasks` sits beside the package."""
    try:
        import eval_tasks  # the metrics' folder, when installed as a package beside hf_kvcompress

        folders = [Path(p) for p in eval_tasks.__path__]
    except ImportError:
        folders = []
    folders.append(Path(__file__).resolve().parents[2] / "eval_tasks")
    for folder in folders:
        if (folder / "metrics").is_dir():
            return folder / "metrics"
    raise FileNotFoundError("eval_tasks/metrics/ was not found next to hf_kvcompress")


@cache
def load_metric(name: str):
    """`evaluate.load` of one local metric module: `string_match_all`, `string_match_part` or `exact_match`."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; choose from {METRICS}")
    import evaluate  # the eval extra's

    return evaluate.load(str(metrics_dir() / f"{name}.py"))


def clean_prediction(text: str) -> str:
    """Strip whitespace and control characters, as RULER's postprocess_pred does before matching."""
    return "".join("\n" if ord(ch) < 32 else ch for ch in text).strip()


def score_all(predictions: list[str], references: list[list[str]]) -> dict[str, list[float]]:
    """Every metric's per-sample scores (0 to 100) for a batch of predictions."""
    predictions = [clean_prediction(p) for p in predictions]
    return {
        name: list(load_metric(name).compute(predictions=predictions, references=references)["scores"])
        for name in METRICS
    }
