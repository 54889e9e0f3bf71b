"""Summaries of evaluation records: tables (markdown, CSV), depth x length heatmaps and a quality-vs-memory plot.

Every table puts the uncompressed score (`dynamic`) beside each method. A task on which the uncompressed cache
scores below 50 is flagged "too hard for this model" and left out of the ranking: there a compressed cache can
only look good by luck.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .. import registry
from .tasks import BANDS, band_of, sample_split

BASELINE = "dynamic"
TOO_HARD_BELOW = 50.0
MiB = 1024 * 1024


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def served_bytes(record: dict, kind: str) -> float:
    """A record's KV bytes (`kind` "document" or "peak") at the dtype the model is served in; records written before
    that was counted have only the bytes measured in the dtype the model ran in."""
    return record.get(f"kv_bytes_{kind}_served", record[f"kv_bytes_{kind}"])


def bytes_dtypes(records: list[dict]) -> tuple[str, str]:
    """(the dtype the reports' bytes are counted at, the dtype the model ran in), as one phrase each."""
    served = sorted({str(r["served_dtype"]) for r in records if r.get("served_dtype")})
    ran = sorted({str(r["dtype"]) for r in records if r.get("dtype")})
    if not served:
        return "/".join(ran) or "the dtype the model ran in", "/".join(ran) or "?"
    return "/".join(served), "/".join(ran) or "?"


def record_split(record: dict) -> str:
    """The half (`dev` or `test`) a record's sample came from; a record written before halves were recorded
    has it from its index."""
    if record.get("split"):
        return str(record["split"])
    return sample_split(int(record["index"])) if record.get("index") is not None else "?"


def splits_sentence(splits: list[str]) -> str:
    """What the reports say about the halves their records came from."""
    if not splits or "?" in splits:
        return "Split: not recorded for every result (results written before the halves were)."
    if splits == ["test"]:
        return "Split: test (the held-out half of every cell's samples; methods are tuned on dev)."
    if splits == ["dev"]:
        return "Split: dev (the half methods and defaults are tuned on; report the test half)."
    return f"Split: {' and '.join(splits)} (both halves of the samples; report the test half alone)."


def summarize(records: list[dict]) -> dict:
    """Aggregate records per (task, method) and per method.

    Returns a dict with:
        rows: one dict per (task, method): n, score, correct (percent), dynamic (the baseline's score on the
            task), delta, retention (of the samples the baseline answers, the share this method answers too: the
            measure of what compression costs), retained and answered (its numerator and denominator),
            kv_bytes_document, kv_bytes_peak (at the served dtype, `served_bytes`), memory_ratio
            (peak / dynamic's peak), tokens_kept,
            prefill_seconds, decode_seconds, too_hard, by_length {length: score}, by_band {band: score} (depth
            bands start, middle, end).
        ranking: one dict per method over the tasks that are not too hard, best first: score, dynamic, delta,
            retention (pooled over those tasks' answered samples), retained, answered, kv_bytes_peak, memory_ratio,
            tasks.
        too_hard: {task: dynamic score} for the flagged tasks.
        methods, tasks, protocols, splits: in first-seen order (splits: the halves the samples came from).
        bytes_dtype, run_dtype: the dtype the bytes are counted at (served) and the one the model ran in.
    """
    methods = list(dict.fromkeys(r["method"] for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[record["task"], record["method"]].append(record)
    baseline = {t: _mean(r["score"] for r in groups.get((t, BASELINE), [])) for t in tasks}
    baseline_peak = {t: _mean(served_bytes(r, "peak") for r in groups.get((t, BASELINE), [])) for t in tasks}
    too_hard = {t: s for t, s in baseline.items() if not math.isnan(s) and s < TOO_HARD_BELOW}
    # The samples the uncompressed cache answers, per task (records from before sample ids count none).
    answered_by_baseline = {
        t: {r["sample_id"] for r in groups.get((t, BASELINE), []) if r.get("correct") and "sample_id" in r}
        for t in tasks
    }
    rows = []
    for task in tasks:
        for method in methods:
            group = groups.get((task, method))
            if not group:
                continue
            score = _mean(r["score"] for r in group)
            peak = _mean(served_bytes(r, "peak") for r in group)
            answered = [r for r in group if r.get("sample_id") in answered_by_baseline[task]]
            retained = sum(bool(r["correct"]) for r in answered)
            by_length: dict[int, list[float]] = defaultdict(list)
            by_band: dict[str, list[float]] = defaultdict(list)
            for r in group:
                by_length[r["length"]].append(r["score"])
                by_band[band_of(r["depth"])].append(r["score"])
            rows.append({
                "task": task, "method": method, "n": len(group), "score": score,
                "correct": 100 * _mean(float(r["correct"]) for r in group),
                "dynamic": baseline[task], "delta": score - baseline[task],
                "retention": retained / len(answered) if answered else float("nan"), "retained": retained,
                "answered": len(answered),
                "kv_bytes_document": _mean(served_bytes(r, "document") for r in group), "kv_bytes_peak": peak,
                "memory_ratio": peak / baseline_peak[task] if baseline_peak[task] else float("nan"),
                "tokens_kept": _mean(r["tokens_kept"] for r in group),
                "prefill_seconds": _mean(r["prefill_seconds"] for r in group),
                "decode_seconds": _mean(r["decode_seconds"] for r in group),
                "too_hard": task in too_hard,
                "by_length": {length: _mean(v) for length, v in sorted(by_length.items())},
                "by_band": {name: _mean(by_band[name]) for name, _, _ in BANDS if name in by_band},
            })  # fmt: skip
    ranking = []
    for method in methods:
        usable = [r for r in rows if r["method"] == method and not r["too_hard"]]
        if not usable:
            continue
        retained, answered = sum(r["retained"] for r in usable), sum(r["answered"] for r in usable)
        ranking.append({
            "method": method, "score": _mean(r["score"] for r in usable),
            "dynamic": _mean(r["dynamic"] for r in usable), "delta": _mean(r["delta"] for r in usable),
            "retention": retained / answered if answered else float("nan"), "retained": retained,
            "answered": answered,
            "kv_bytes_peak": _mean(r["kv_bytes_peak"] for r in usable),
            "memory_ratio": _mean(r["memory_ratio"] for r in usable), "tasks": len(usable),
        })  # fmt: skip
    ranking.sort(key=lambda r: (-r["score"], r["kv_bytes_peak"]))
    protocols = list(dict.fromkeys(r.get("protocol", "?") for r in records))
    splits = sorted({record_split(r) for r in records})
    bytes_dtype, run_dtype = bytes_dtypes(records)
    return {"rows": rows, "ranking": ranking, "too_hard": too_hard, "methods": methods, "tasks": tasks,
            "protocols": protocols, "splits": splits, "bytes_dtype": bytes_dtype, "run_dtype": run_dtype}  # fmt: skip


def _f(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _mib(value) -> str:
    return _f(value / MiB if value is not None else None, 2)


def _describe(spec: str) -> str | None:
    """The registry's one-line description of a method, when the registry offers one."""
    try:
        describer = getattr(registry, "describe", None)
        return describer(spec) if describer is not None else None
    except Exception:  # a description is a courtesy; a spec the registry no longer parses still gets its table
        return None


def _retention(row: dict) -> str:
    """'0.83 (10 / 12)': the share of the baseline's answered samples kept, with its counts."""
    if not row.get("answered"):
        return "-"
    return f"{row['retention']:.2f} ({row['retained']} / {row['answered']})"


def _bytes_sentence(summary: dict) -> str:
    served, ran = summary.get("bytes_dtype", "?"), summary.get("run_dtype", "?")
    if served == ran:
        return f"KV bytes are measured storage per sample, in {served}, the dtype the model ran in."
    return (f"KV bytes are storage per sample at {served}, the dtype the model is served in (it ran in {ran} here: "
            f"the measured storage with keys and values counted at {served}'s width); memory vs dynamic is "
            f"against the uncompressed {served} cache.")


def markdown(summary: dict, records: list[dict], notes: Sequence[str] = ()) -> str:
    """The summary as markdown: `notes`, the ranking, then one table per task (with scores by context length)."""
    models = sorted({str(r.get("model")) for r in records})
    lines = [
        "# Long-context evaluation",
        "",
        f"Model: {', '.join(models)}. Protocol: {', '.join(summary['protocols'])} "
        "(document_first: the document is prefilled and compressed before the question is appended; "
        "query_aware: the question is also inside the compressed prompt). "
        f"{len(records)} results. Scores 0-100. {_bytes_sentence(summary)}",
        "",
        splits_sentence(summary.get("splits") or []),
        "",
        *[line for note in notes for line in (note, "")],
    ]
    described = [(m, _describe(m)) for m in summary["methods"]]
    if any(text for _, text in described):
        lines += [f"- `{m}`: {text}" for m, text in described if text] + [""]
    lines += [f"## Ranking (tasks where `{BASELINE}` scores >= {TOO_HARD_BELOW:.0f})", ""]
    if summary["ranking"]:
        lines += [f"| rank | method | score | dynamic | delta | retention (kept / answered by `{BASELINE}`) | "
                  f"KV peak (MiB, {summary.get('bytes_dtype', '?')}) | memory vs dynamic | tasks |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for n, r in enumerate(summary["ranking"], 1):
            lines.append(f"| {n} | `{r['method']}` | {_f(r['score'])} | {_f(r['dynamic'])} | {_f(r['delta'])} | "
                         f"{_retention(r)} | {_mib(r['kv_bytes_peak'])} | {_f(r['memory_ratio'], 3)} | "
                         f"{r['tasks']} |")  # fmt: skip
    else:
        lines.append("No task is easy enough for this model (every uncompressed score is below 50): nothing ranked.")
    for task in summary["tasks"]:
        rows = [r for r in summary["rows"] if r["task"] == task]
        lengths = sorted({length for r in rows for length in r["by_length"]})
        bands = [name for name, _, _ in BANDS if any(name in r.get("by_band", {}) for r in rows)]
        flag = ""
        if task in summary["too_hard"]:
            flag = f" (too hard for this model: `{BASELINE}` scores {_f(summary['too_hard'][task])} < 50; not ranked)"
        metric = next((r.get("metric") for r in records if r["task"] == task), "")
        lines += ["", f"## `{task}` ({metric}){flag}", ""]
        head = ["method", "score", "dynamic", "delta", "correct %", "retention"]
        head += [f"L{length}" for length in lengths] + bands
        head += [f"KV doc (MiB, {summary.get('bytes_dtype', '?')})", "KV peak (MiB)", "memory vs dynamic",
                 "tokens kept", "prefill s", "decode s", "n"]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for r in rows:
            cells = [f"`{r['method']}`", _f(r["score"]), _f(r["dynamic"]), _f(r["delta"]), _f(r["correct"]),
                     _retention(r)]
            cells += [_f(r["by_length"].get(length)) for length in lengths]
            cells += [_f(r.get("by_band", {}).get(name)) for name in bands]
            cells += [_mib(r["kv_bytes_document"]), _mib(r["kv_bytes_peak"]), _f(r["memory_ratio"], 3),
                      _f(r["tokens_kept"], 0), _f(r["prefill_seconds"], 2), _f(r["decode_seconds"], 2),
                      str(r["n"])]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("task", "method", "n", "score", "dynamic", "delta", "correct", "retention", "retained", "answered",
              "kv_bytes_document", "kv_bytes_peak", "memory_ratio", "tokens_kept", "prefill_seconds",
              "decode_seconds", "too_hard")  # fmt: skip


def write_csv(summary: dict, path: str | os.PathLike) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in summary["rows"]:
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})


def slug(text: str) -> str:
    """A file-name-safe form of a method spec."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_")


def plot_heatmaps(records: list[dict], out_dir: str | os.PathLike) -> list[Path]:
    """One PNG per method: for each task, the mean score on a depth (rows) x length (columns) grid."""
    import matplotlib  # the eval extra's: plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    too_hard = summarize(records)["too_hard"]
    methods = list(dict.fromkeys(r["method"] for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for method in methods:
        mine = [r for r in records if r["method"] == method]
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks) + 1, 3.8), squeeze=False,
                                 constrained_layout=True)  # fmt: skip
        for ax, task in zip(axes[0], tasks, strict=True):
            cells: dict[tuple[float, int], list[float]] = defaultdict(list)
            for r in mine:
                if r["task"] == task:
                    cells[r["depth"], r["length"]].append(r["score"])
            depths = sorted({d for d, _ in cells})
            lengths = sorted({length for _, length in cells})
            grid = [[_mean(cells.get((d, length), [])) for length in lengths] for d in depths]
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("depth (%)")
            hard = " (too hard for this model)" if task in too_hard else ""
            ax.set_title(task + hard, fontsize=9)
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    if not math.isnan(value):
                        ax.text(x, y, f"{value:.0f}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="score")
        fig.suptitle(method, fontsize=10)
        path = Path(out_dir) / f"heatmap_{slug(method)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_quality_vs_memory(summary: dict, out_dir: str | os.PathLike) -> Path:
    """Mean score against mean peak KV memory per method (ranked tasks, or all tasks if none is rankable)."""
    import matplotlib  # the eval extra's: plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = summary["ranking"]
    title = "tasks the uncompressed cache scores >= 50 on"
    if not points:
        title = "all tasks (all too hard for this model)"
        points = [
            {"method": m, "score": _mean(r["score"] for r in summary["rows"] if r["method"] == m),
             "kv_bytes_peak": _mean(r["kv_bytes_peak"] for r in summary["rows"] if r["method"] == m)}
            for m in summary["methods"]
        ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    # Methods are named in a legend beside the axes, each with its own marker and colour: labels written at the
    # points overlapped wherever two methods hold the same memory and score (h2o and sink_window at budget 256).
    colors = [f"C{k}" for k in range(10) if k != 3]  # red (C3) is the baseline's alone
    markers = "osD^vP*Xph<>"
    for i, p in enumerate(points):
        baseline = p["method"] == BASELINE
        ax.scatter(p["kv_bytes_peak"] / MiB, p["score"], s=44, label=p["method"], alpha=0.85,
                   color="tab:red" if baseline else colors[i % len(colors)],
                   marker="o" if baseline else markers[i % len(markers)])  # fmt: skip
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7, frameon=False, borderaxespad=0)
    ax.set_xlabel("peak KV cache per sample (MiB, measured)")
    ax.set_ylabel("mean score (0-100)")
    ax.set_ylim(-5, 105)
    ax.set_title(f"Quality vs memory: {title}", fontsize=9)
    ax.grid(alpha=0.3)
    path = Path(out_dir) / "quality_vs_memory.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_reports(records: list[dict], out_dir: str | os.PathLike, notes: Sequence[str] = ()) -> dict:
    """summary.md (`notes` under its header), summary.csv, heatmap_<method>.png and quality_vs_memory.png in
    `out_dir`; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    (out / "summary.md").write_text(markdown(summary, records, notes), encoding="utf-8")
    write_csv(summary, out / "summary.csv")
    if records:
        plot_heatmaps(records, out)
        plot_quality_vs_memory(summary, out)
    return summary
