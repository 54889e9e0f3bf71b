"""`hf-kvcompress study`: the quality-versus-memory study (what `make demo` runs)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from ..budget import GIB


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated whole numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{name} takes positive whole numbers, got {text!r}")
    return values


def add_parser(subparsers) -> None:
    from .checks import DefaultsHelpFormatter

    parser = subparsers.add_parser(
        "study",
        help="quality versus memory of every plan on long-context recall",
        description=__doc__ + " Results are kept in --out; a rerun with the same settings reuses them.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None,
                        help="model to study (default: the first embedded model whose uncompressed needle score "
                             "reaches 70; each embedded model's baseline is reported)")
    parser.add_argument("--lengths", default="1000", help="document lengths in the model's tokens (comma-separated)")
    parser.add_argument("--depths", default="10,50,90", help="needle depths in percent of the document (comma-separated)")
    parser.add_argument("--tasks", default="needle,multi_needle", help="evaluation tasks (see hf-kvcompress eval)")
    parser.add_argument("--plans", default=None, help="cache specs separated by ';' (default: the registry's study plans, scaled to the shortest length)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB", help="GPU memory for the users-per-GPU table")
    parser.add_argument("--context", type=int, default=32000, help="tokens per user for the users-per-GPU table")
    parser.add_argument("--weights", type=float, default=None, metavar="GIB", help="weights in GiB (default: the model's)")
    parser.add_argument("--reserve", type=float, default=0.0, metavar="GIB",
                        help="GPU memory kept free for activations and the runtime, for the users-per-GPU table")
    parser.add_argument("--min-quality", type=float, default=10.0,
                        help="largest loss in score points a plan may have to count as usable")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per forward pass (see hf-kvcompress eval)")
    parser.add_argument("--samples-per-cell", type=int, default=1, help="samples per (task, length, depth) cell")
    parser.add_argument("--out", default="results/study", help="output directory")
    parser.set_defaults(func=run)


def _baseline(records: list[dict], task: str = "needle") -> float:
    scores = [r["score"] for r in records if r["method"] == "dynamic" and r["task"] == task]
    return sum(scores) / len(scores) if scores else float("nan")


def run(args) -> int:
    from .. import study
    from ..eval.report import summarize
    from ..eval.runner import check_specs, run_eval
    from ..eval.tasks import parse_task
    from ..models import load_model

    lengths = _ints(args.lengths, "lengths")
    try:
        depths = [float(v) for v in args.depths.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--depths takes comma-separated percentages, got {args.depths!r}") from None
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths are percentages between 0 and 100, got {args.depths!r}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.min_quality < 0:
        raise ValueError(f"--min-quality must be >= 0 score points, got {args.min_quality}")
    plans = [p.strip() for p in args.plans.split(";") if p.strip()] if args.plans else study.study_plans(lengths)
    for task in tasks:
        parse_task(task)
    check_specs(plans)  # a typo fails now, not after the baseline has run
    for flag, value in (("--batch-size", args.batch_size), ("--samples-per-cell", args.samples_per_cell)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    out = Path(args.out)
    started = time.perf_counter()
    common = dict(tasks=tasks, lengths=lengths, depths=depths, batch_size=args.batch_size,
                  samples_per_cell=args.samples_per_cell)

    baselines: dict[str, float] = {}
    chosen = args.model
    if chosen is None:
        # The rule: study the first embedded model whose uncompressed needle score reaches BASELINE_RULE (else the
        # best one); compression losses are invisible when the uncompressed model already fails.
        for name in study.EMBEDDED_MODELS:
            model, tokenizer = load_model(name)
            records = run_eval(model, tokenizer, ["dynamic"], out_dir=out / name, model_name=name,
                               **{**common, "tasks": ["needle"]})
            baselines[name] = _baseline(records)
            print(f"baseline: {name} uncompressed needle score {baselines[name]:.1f}")
            del model
            gc.collect()
            if baselines[name] >= study.BASELINE_RULE:
                chosen = name
                break
        if chosen is None:
            chosen = max(baselines, key=baselines.get)
    model, tokenizer = load_model(chosen)
    name = chosen
    counts: dict = {}
    records = run_eval(model, tokenizer, plans, out_dir=out / Path(name).name, model_name=name, counts=counts, **common)
    summary = summarize(records)
    usable = {t for t in summary["tasks"] if t not in summary["too_hard"]}
    if not usable:
        usable = set(summary["tasks"])
        print("note: every task is under 50 for the uncompressed cache; ranking over all of them anyway")
    model_bytes = next(model.parameters()).element_size()
    weights = args.weights * GIB if args.weights is not None else study.model_weight_bytes(model)
    results = study.analyse(records, model.config, model_bytes, weights, args.gpu_memory * GIB, args.context,
                            args.reserve * GIB, usable)
    best = study.recommend(results, args.min_quality)
    tokens = sum(r["document_tokens"] for r in records if r["method"] == "dynamic") / max(
        1, sum(r["method"] == "dynamic" for r in records))
    lines = [
        f"# Study: {name}",
        "",
        f"Tasks {', '.join(tasks)} at {args.lengths} tokens, depths {args.depths}; question after the document "
        f"(protocol {', '.join(summary['protocols'])}); {len(records)} runs ({counts['to_run']} run now, "
        f"{counts['reused']} reused from results already in {args.out}) in {time.perf_counter() - started:.0f} s.",
    ]
    if baselines:
        lines.append("Uncompressed needle score per embedded model: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in baselines.items())
                     + f" (studied: the first reaching {study.BASELINE_RULE:g}, else the best).")
    if summary["too_hard"]:
        lines.append("Too hard for this model (uncompressed < 50, not ranked): "
                     + ", ".join(f"{t} {s:.0f}" for t, s in summary["too_hard"].items()))
    notes = study.residual_notes(results, tokens)
    lines += ["", "```", study.format_table(results, tokens), *(["", notes] if notes else []), "", study.format_users(
        results, args.min_quality, args.gpu_memory * GIB, weights, args.context), "", study.recommendation_text(best, results),
        "```", "", f"Plots: {out / Path(name).name}/quality_vs_memory.png and heatmap_<method>.png"]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    study.report_path(out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0
