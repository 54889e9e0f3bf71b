"""`hf-kvcompress study`: the quality-versus-memory study (what `make demo` runs)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

from ..budget import GIB, dtype_bytes, weight_bytes
from ..extras import require
from .checks import DefaultsHelpFormatter


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated whole numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{name} takes positive whole numbers, got {text!r}")
    return values


# Each preset: the grid, the plans (a registry tuple, scaled to the shortest length) and the answer's token cap.
PRESETS: dict[str, dict[str, Any]] = {
    # make demo on 2 CPU cores: 30 scored samples per plan (2 lengths x 5 depths x 3), documents of about 1,000 and
    # 1,250 tokens (a length counts the whole prompt; the question and the chat markup take about 40 of it), each
    # family at its best measured setting and the lesson's stacked ones, from the one shared prefill per document
    # (KVzip adds its reconstruction pass; KVzap prefills on its own). 2,048 and 2,304 tokens cost 3.2
    # times the CPU time per prefill and could not fit KVzip into 10 minutes. A 7-digit needle and its full stop
    # are 9 of SmolLM2's tokens: 10 new tokens are enough and every one is a step of every plan.
    "demo": dict(lengths="1024,1280", depths="10,30,50,70,90", tasks="needle", samples_per_cell=3,
                 plans="STUDY_PLANS", max_new_tokens=10),
    # the evictions that must see the prefill (H2O, SnapKV: its attention), each with its own prefill, beside KVzip
    # at the same budget, at the former demo's lengths.
    "eviction": dict(lengths="2048,2304", depths="10,30,50,70,90", tasks="needle", samples_per_cell=3,
                     plans="EVICTION_STUDY_PLANS", max_new_tokens=10),
    # a GPU and a long-context model: every plan of both at 4k-32k, needle and multi-needle, the tasks' own caps.
    "full": dict(lengths="4000,8000,16000,32000", depths="0,10,25,50,75,90,100", tasks="needle,multi_needle",
                 samples_per_cell=3, plans="STUDY_PLANS,EVICTION_STUDY_PLANS", max_new_tokens=None),
}


def preset_plans(preset: str, lengths: list[int], config) -> list[str]:
    """The preset's plans, scaled to the shortest length and the model's head_dim, each once."""
    from .. import registry, study  # the registry reads torch: imported when a study runs, not for --help

    plans = []
    for name in PRESETS[preset]["plans"].split(","):
        plans += study.study_plans(lengths, config, getattr(registry, name))
    return list(dict.fromkeys(plans))


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "study",
        help="quality versus memory of every plan on long-context recall",
        description=__doc__ + " Each document is prefilled once and every plan that can reuse that prefill does; "
        "the report, records and plots are written to --out (a rerun computes them again).",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None,
                        help="model to study (default: the first embedded model whose uncompressed needle score "
                             "reaches 70; each embedded model's baseline is reported)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                        help="lengths, depths, tasks, samples, plans and answer length: 'demo' (every family at its "
                             "best measured setting, KVzip and KVzap included, on 2 CPU cores in under 10 minutes), "
                             "'eviction' (H2O, SnapKV: each prefills on its own; KVzip beside them) or 'full' (both "
                             "sets at 4k-32k, for a GPU)")
    parser.add_argument("--lengths", default=None, help="document lengths in the model's tokens (comma-separated)")
    parser.add_argument("--depths", default=None, help="needle depths in percent of the document")
    parser.add_argument("--tasks", default=None, help="evaluation tasks (see hf-kvcompress eval)")
    parser.add_argument("--plans", default=None, help="cache specs separated by ';' (default: the preset's plans)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="cap on each answer's tokens (default: the preset's; 0: the tasks' own)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that split the samples, one per core on a CPU (default: the cores, at most "
                             "4, on a CPU; 1 on a GPU)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                        help="GPU memory for the users-per-GPU table")
    parser.add_argument("--context", type=int, default=32000,
                        help="tokens per user for the users-per-GPU table (at most the model's "
                             "max_position_embeddings: a longer context is cut to it, and the report says so)")
    parser.add_argument("--weights", type=float, default=None, metavar="GIB",
                        help="weights in GiB (default: the model's)")
    parser.add_argument("--reserve", type=float, default=0.0, metavar="GIB",
                        help="GPU memory kept free for activations and the runtime, for the users-per-GPU table")
    parser.add_argument("--min-quality", type=float, default=10.0,
                        help="largest loss in score points a plan may have to count as usable (default 10)")
    parser.add_argument("--batch-size", type=int, default=5, help="samples per batch (one shared prefill each)")
    parser.add_argument("--samples-per-cell", type=int, default=None,
                        help="samples per (task, length, depth) cell (default: the preset's, 3)")
    parser.add_argument("--split", choices=("dev", "test", "all"), default="test",
                        help="which half of each cell's samples: test (the half the study reports), dev (the half "
                             "methods are tuned on) or all")
    parser.add_argument("--out", default="results/study", help="output directory")
    parser.set_defaults(func=run)


def _baseline(records: list[dict], task: str = "needle") -> float:
    scores = [r["score"] for r in records if r["method"] == "dynamic" and r["task"] == task]
    if not scores:
        scores = [r["score"] for r in records if r["method"] == "dynamic"]
    return sum(scores) / len(scores) if scores else float("nan")


def _usable_plans(plans: list[str], config) -> tuple[list[str], dict[str, str]]:
    """The plans this model can run, and why each other one is refused (e.g. sharing on a one-KV-head model)."""
    from ..registry import make_cache  # as in preset_plans

    usable, refused = [], {}
    for plan in plans:
        try:
            make_cache(plan, config)
        except (ValueError, FileNotFoundError) as error:
            refused[plan] = str(error)
        else:
            usable.append(plan)
    return usable, refused


def run(args) -> int:
    require("eval", "hf-kvcompress study")  # before any of the eval extra's modules is imported
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from .. import study
    from ..eval.report import plot_heatmaps, splits_sentence, summarize
    from ..eval.runner import check_specs, served_name
    from ..eval.tasks import build_samples, parse_task
    from ..hf.compat import text_config
    from ..lesson_table import format_lesson_table, lesson_rows
    from ..models import load_model
    from ..study_workers import default_workers, run_plans_split

    preset = PRESETS[args.preset]
    lengths = _ints(args.lengths or preset["lengths"], "lengths")
    depths_text = args.depths or preset["depths"]
    try:
        depths = [float(v) for v in depths_text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--depths takes comma-separated percentages, got {depths_text!r}") from None
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depths are percentages between 0 and 100, got {depths_text!r}")
    tasks = [t.strip() for t in (args.tasks or preset["tasks"]).split(",") if t.strip()]
    if args.min_quality < 0:
        raise ValueError(f"--min-quality must be >= 0 score points, got {args.min_quality}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    per_cell = args.samples_per_cell or preset["samples_per_cell"]
    if per_cell < 1:
        raise ValueError(f"--samples-per-cell must be >= 1, got {per_cell}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    max_new = preset["max_new_tokens"] if args.max_new_tokens is None else (args.max_new_tokens or None)
    if max_new is not None and max_new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, or 0 for the tasks' own, got {args.max_new_tokens}")
    requested = [p.strip() for p in args.plans.split(";") if p.strip()] if args.plans else None
    for task in tasks:
        parse_task(task)
    if requested:
        check_specs(requested)  # a typo fails now, before any model loads
    out = Path(args.out)
    started = time.perf_counter()
    cpu_started = time.process_time()

    # The rule: study the first embedded model whose uncompressed needle score reaches BASELINE_RULE (else the
    # best one); compression losses are invisible when the uncompressed model already fails. Every plan runs in
    # the same pass as the baseline (one shared prefill per sample), so the rule costs nothing when the first passes.
    candidates = [args.model] if args.model else list(study.EMBEDDED_MODELS)
    baselines: dict[str, float] = {}
    runs = {}
    for name in candidates:
        model, tokenizer = load_model(name)
        plans = requested or preset_plans(args.preset, lengths, model.config)
        plans, refused = _usable_plans(list(dict.fromkeys(["dynamic", *plans])), model.config)
        samples = build_samples(tokenizer, tasks, lengths, depths, samples_per_cell=per_cell, seed=0, split=args.split)
        workers = args.workers or default_workers(model.device.type)
        workers_used = min(workers, len(samples))

        def progress(done: int, share: int, name: str = name, total: int = len(samples),
                     workers_used: int = workers_used, plans: list[str] = plans) -> None:
            part = f" (this process's share of {total}; {workers_used - 1} more processes)" if share < total else ""
            print(f"  {name}: {done}/{share} samples{part} x {len(plans)} plans, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)

        records = run_plans_split(model, tokenizer, plans, samples, workers=workers, model_name=name,
                                  batch_size=args.batch_size, max_new_tokens=max_new, progress=progress)
        baselines[name] = _baseline(records)
        print(f"{name}: uncompressed needle score {baselines[name]:.1f} over {len(samples)} samples")
        runs[name] = (model, records, refused)
        if baselines[name] >= study.BASELINE_RULE or args.model:
            break
        del model
        gc.collect()
    if args.model:
        name = args.model
    else:
        name = max(runs, key=lambda n: (baselines[n] >= study.BASELINE_RULE, baselines[n]))
    if len(runs) > 1 and baselines[name] < study.BASELINE_RULE:
        name = max(baselines, key=lambda n: baselines[n])
    model, records, refused = runs[name]
    summary = summarize(records)
    usable = {t for t in summary["tasks"] if t not in summary["too_hard"]}
    if not usable:
        usable = set(summary["tasks"])
        print("note: every task is under 50 for the uncompressed cache; ranking over all of them anyway")
    # Bytes at the dtype the model is served in (a CPU runs it in float32; the records count bytes at both).
    served = served_name(model)
    model_bytes = dtype_bytes(served)
    params = sum(p.numel() for p in model.parameters())
    weights = args.weights * GIB if args.weights is not None else weight_bytes(params, served)
    longest = getattr(text_config(model.config), "max_position_embeddings", None)
    context = min(args.context, longest) if longest else args.context
    results = study.analyse(records, model.config, model_bytes, weights, args.gpu_memory * GIB, context,
                            args.reserve * GIB, usable)
    best = study.recommend(results, args.min_quality)
    tokens = sum(r["document_tokens"] for r in records if r["method"] == "dynamic") / max(
        1, sum(r["method"] == "dynamic" for r in records))
    plots = out / Path(name).name
    plots.mkdir(parents=True, exist_ok=True)
    plot_heatmaps(records, plots)
    study.plot_study(results, plots, served)
    with open(plots / "records.jsonl", "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    lesson = lesson_rows(results, model.config, tokens, model_bytes)
    baseline = next(r for r in results if r.spec == "dynamic")
    study.write_results(results, lesson, plots / "study.json", model=name, tokens=tokens, bytes_dtype=served,
                        context=context, split=args.split)
    n = len(records) // max(1, len(results))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    answer = f"answers capped at {max_new} new tokens" if max_new else "the tasks' own answer lengths"
    lines = [
        f"# Study: {name}",
        "",
        f"Tasks {', '.join(tasks)} at {','.join(map(str, lengths))} tokens, depths {depths_text}, {per_cell} samples "
        f"per cell: {n} scored samples per plan; question after the document (protocol "
        f"{', '.join(summary['protocols'])}); {answer}; {len(records)} runs in {seconds:.0f} s with {workers_used} "
        f"process(es) ({cpu:.0f} s of this process's CPU time; {seconds / max(1, n):.1f} s per sample for all "
        f"{len(results)} plans).",
        splits_sentence(summary["splits"]),
    ]
    if not args.model:
        lines.append("Uncompressed needle score per embedded model: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in baselines.items())
                     + f" (studied: the first reaching {study.BASELINE_RULE:g}, else the best).")
    if summary["too_hard"]:
        lines.append("Too hard for this model (uncompressed < 50, not ranked): "
                     + ", ".join(f"{t} {s:.0f}" for t, s in summary["too_hard"].items()))
    for plan, why in refused.items():
        lines.append(f"Refused for this model: {plan}: {why}")
    ran = str(model.dtype).removeprefix("torch.")
    lines.append(f"Bytes are at {served}, the dtype the model is served in" + (
        f" (it ran in {ran} here: the measured storage with keys and values counted at {served}'s width; "
        "tests/test_served_bytes.py checks that against runs in it)." if ran != served else "."))
    if context < args.context:
        lines.append(f"Users per GPU at {context:,} tokens, this model's max_position_embeddings "
                     f"(--context {args.context:,} is past it).")
    notes = study.residual_notes(results, tokens, model.config)
    lines += ["", "```", study.format_table(results, tokens, served), *(["", notes] if notes else []), "",
              "The lesson's table, with the quality it could not show (score and retention measured above):",
              format_lesson_table(lesson, baseline), "", study.format_users(
        results, args.min_quality, args.gpu_memory * GIB, weights, context, served, tokens), "",
        study.recommendation_text(best, results),
        "```", "", "Retention: share of the samples the uncompressed cache answers that the plan still answers. "
        f"Formula: the lesson's 2 x layers x kv_heads x head_dim x bytes x tokens at {served}; measured: what the "
        f"cache held, at {served}; x less: the uncompressed cache's measured bytes / the plan's.",
        f"Plots: {plots}/quality_vs_memory.png and heatmap_<plan>.png; numbers: {plots}/study.json"]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    study.report_path(out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0
