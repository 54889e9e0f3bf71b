"""Retention table from evaluation records: per method, the share of the samples the uncompressed cache answers
that the method still answers, overall (with a 95% Wilson interval) and per depth band, beside its bytes.

Question: of the samples the uncompressed cache answers, how many does each method in an `hf-kvcompress eval` run
still answer, overall and by depth, and at what share of the bytes?
Command:
    python benchmarks/probes/retention_table.py OUT_DIR [OUT_DIR ...]   # folders written by `hf-kvcompress eval`
Written up: the docs/results.md retention tables in "The suite: retention at each width", "Eviction policies side by
side (question after the document)", "Expected Attention" and "Gemma-3's sliding layers under eviction (0.4.0)".

Bytes are the method's mean measured document bytes over the uncompressed cache's, on the same samples, counted in
the dtype the model is served in (`kv_bytes_document_served`; the run's own dtype for records without it): a float32
run of a 16-bit model would otherwise count a codec's exact residual at twice its served width beside its encoded
tokens, and an int4 cache as a smaller share than it holds. Records
from several folders (models) are kept apart by model. kvpress_side_by_side.py writes its records in the same form.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from hf_kvcompress.study import BANDS, wilson

BASELINE = "dynamic"


def load(folder: str | Path) -> list[dict]:
    path = Path(folder) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _document_bytes(record: dict) -> float:
    """A record's bytes after the document, in the served dtype where the record has them."""
    return record.get("kv_bytes_document_served") or record.get("kv_bytes_document") or 0.0


def table(records: list[dict]) -> str:
    """A Markdown table, one row per (model, method), baseline first."""
    by = defaultdict(list)
    for r in records:
        by[r.get("model", "?"), r["method"]].append(r)
    lines = ["| model | method | n answered by baseline | retention % (95% CI) | start | middle | end "
             "| bytes / baseline |",
             "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(m for m, _ in by):
        base = {r["sample_id"]: r for r in by.get((model, BASELINE), [])}
        answered = {s for s, r in base.items() if r["correct"]}
        base_bytes = [_document_bytes(r) for r in base.values()]
        for (m, method), rows in by.items():
            if m != model:
                continue
            paired = [r for r in rows if r["sample_id"] in answered]
            kept = sum(1 for r in paired if r["correct"])
            low, high = wilson(kept, len(paired)) if paired else (float("nan"), float("nan"))
            bands = []
            for _, lo, hi in BANDS:
                band = [r for r in paired if lo <= r["depth"] < hi]
                bands.append(f"{100 * sum(r['correct'] for r in band) / len(band):.0f} ({len(band)})" if band else "-")
            same = [_document_bytes(r) for r in rows if r["sample_id"] in base and _document_bytes(r)]
            ref = [_document_bytes(base[r["sample_id"]]) for r in rows
                   if r["sample_id"] in base and _document_bytes(r)]
            fraction = f"{sum(same) / sum(ref):.3f}" if same and sum(ref) else "-"
            retention = f"{100 * kept / len(paired):.0f} ({low:.0f}-{high:.0f})" if paired else "-"
            lines.append(f"| {model} | {method} | {len(paired)} of {len(rows)} | {retention} | {' | '.join(bands)} "
                         f"| {fraction} |")
        if not base_bytes:
            lines.append(f"| {model} | (no {BASELINE} records: no retention) | | | | | | |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    print(table([r for folder in args.folders for r in load(folder)]))


if __name__ == "__main__":
    main()
