"""What the lm-eval task folders eval_tasks/kvc_*/ call: their datasets, prompt text and scoring.

A task's samples come from the suite, never the Hub: either the files `hf-kvcompress eval` wrote
(`--metadata '{"data_dir": "RUN_DIR"}'` reads RUN_DIR/data/<task>.jsonl, the very samples of that run), or
built here with the model's tokenizer (`pretrained` from `--model_args`) and the suite's parameters given in
`--metadata`: lengths, depths, samples, seed, split, limit, documents, prompt_format, and the task's own
parameters under `task_args` (e.g. {"kind": "passkey"}). `split` is the half of the samples (`test`, the default,
or `dev`, `all`; see tasks.sample_split): each task's `kvc_<task>_dev` variant sets it to `dev`, and with
`data_dir` it keeps that run's samples of the half.
"""

from __future__ import annotations

import json
from pathlib import Path

from .prompts import PromptFormat, plain_text
from .scoring import score_all


def _as_list(value, cast):
    if isinstance(value, str):
        value = [v for v in value.replace(";", ",").split(",") if v.strip()]
    if isinstance(value, (int, float)):
        value = [value]
    return [cast(v) for v in value]


def dataset(
    task: str,
    *,
    data_dir: str | None = None,
    pretrained: str | None = None,
    tokenizer: str | None = None,
    lengths=(1000, 2000, 3000),
    depths=(0, 25, 50, 75, 100),
    samples: int = 1,
    seed: int = 0,
    split: str = "test",
    limit: int | None = None,
    documents: str | None = None,
    prompt_format: PromptFormat = "auto",
    task_args: dict | None = None,
    **_ignored,
):
    """A DatasetDict with one `test` split (lm-eval's name for what it scores) holding the suite's samples of `task`
    (a task name from tasks.TASKS) from the half `split`."""
    import datasets  # the eval extra's

    from .tasks import check_split, sample_split  # as below: lm-eval lists tasks without building samples

    check_split(split)

    if data_dir:
        folder = Path(data_dir)
        path = next((p for p in (folder / "data" / f"{task}.jsonl", folder / f"{task}.jsonl") if p.exists()), None)
        if path is None:
            raise FileNotFoundError(
                f"no {task}.jsonl in {folder}/data or {folder}: run `hf-kvcompress eval --tasks {task}` first"
            )
        with open(path, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        if split != "all":
            every = len(rows)
            rows = [r for r in rows if (r.get("split") or sample_split(int(r["index"]))) == split]
            if every and not rows:
                raise ValueError(f"{path} holds no samples of the {split} half (that run built the other one): "
                                 f"pass split in --metadata, or rerun `hf-kvcompress eval --split {split}`")
        if limit is not None:
            rows = rows[: int(limit)]
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
    # lm-eval imports every task folder's utils when it lists tasks: the model and the sample builder load only
    # when a task's samples are built
    from ..models import load_model
    from .tasks import build_samples

    _, tok = load_model(tokenizer or pretrained or None, device="cpu")  # the tokenizer counts the lengths
    spec = task + (":" + ",".join(f"{k}={v}" for k, v in task_args.items()) if task_args else "")
    built = build_samples(
        tok, [spec], _as_list(lengths, int), _as_list(depths, float), samples_per_cell=int(samples), seed=int(seed),
        split=split, documents=documents, prompt_format=prompt_format, limit=None if limit is None else int(limit),
    )  # fmt: skip
    return datasets.DatasetDict({"test": built})


def doc_to_text(doc: dict) -> str:
    """The prompt as plain text (the hf-kvcompress model renders its own from the fields, split for the protocol)."""
    return plain_text(doc)


def doc_to_target(doc: dict) -> str:
    return doc["references"][0]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """The sample's primary score (its `metric`) and exact match, computed as the runner computes them."""
    scores = score_all([results[0]], [doc["references"]])
    return {"score": scores[doc["metric"]][0], "exact_match": scores["exact_match"][0]}
