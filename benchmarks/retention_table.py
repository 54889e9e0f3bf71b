"""Retention and bytes per method and depth band from `hf-kvcompress eval` results (the issue-10 table).

    python benchmarks/retention_table.py results/quant-smol [results/quant-gemma ...]

Retention = the method's total score / the uncompressed cache's total score on the same samples (paired by
sample id; a method's samples without a baseline are left out). Bands: start = depths 0 and 25, middle = 50,
end = 75 and 100. Bytes = the method's measured document KV bytes / the uncompressed cache's on the same samples.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

BANDS = {"start": (0.0, 25.0), "middle": (50.0,), "end": (75.0, 100.0)}


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}" if den else "-"


def table(folder: Path) -> list[str]:
    records = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    baseline = {r["sample_id"]: r for r in records if r["method"] == "dynamic"}
    methods = list(dict.fromkeys(r["method"] for r in records if r["method"] != "dynamic"))
    model = records[0]["model"] if records else "?"
    lines = []
    for method in methods:
        rows = [r for r in records if r["method"] == method and r["sample_id"] in baseline]
        score = defaultdict(float)
        base = defaultdict(float)
        for r in rows:
            b = baseline[r["sample_id"]]
            for band, depths in BANDS.items():
                if r["depth"] in depths:
                    score[band] += r["score"]
                    base[band] += b["score"]
            score["all"] += r["score"]
            base["all"] += b["score"]
        bytes_ = sum(r["kv_bytes_document"] for r in rows) / max(1, sum(baseline[r["sample_id"]]["kv_bytes_document"] for r in rows))
        tasks = ",".join(sorted({r["task"] for r in rows}))
        lengths = ",".join(str(n) for n in sorted({r["length"] for r in rows}))
        bands = " / ".join(_ratio(score[b], base[b]) for b in BANDS)
        lines.append(f"| {model} | {tasks} {lengths} | `{method}` | {len(rows)} | {_ratio(score['all'], base['all'])} | "
                     f"{bands} | {bytes_:.3f} |")
    return lines


def main() -> None:
    print("| model | task, tokens | method | samples | retention | start / middle / end | bytes |")
    print("|---|---|---|---:|---:|---|---:|")
    for folder in sys.argv[1:]:
        print("\n".join(table(Path(folder))))


if __name__ == "__main__":
    main()
