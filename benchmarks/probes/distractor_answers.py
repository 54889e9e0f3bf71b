"""Which answers each method of an eval run loses, and whose number each wrong answer is: the asked needle's digits
changed, or another needle of the same document (where it lies in the document).

Question: of the samples the uncompressed cache answers, which does each method lose, and does it answer them with
another needle's number (which one, how far from the asked one) or with a number the document does not hold?
Command:
    python benchmarks/probes/distractor_answers.py OUT_DIR   # a folder `hf-kvcompress eval` wrote
Written up: docs/results.md, "KVzip's half and `ratio=0.25+int4` spent differently, development half (issue 27,
session 30)".

The samples are rebuilt from the records' settings (task, length, depth, split, seed; `build_samples`, tokenizer
only: no model runs), so the folder needs no documents stored. A number counts as another needle's when its digits
(4 or more) occur in the document and are not the asked reference; its position is the share of the document's
characters before it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

BASELINE = "dynamic"
DIGITS = r"\d{4,}"
KEY = r"for ([\w-]+)[^.]*?$"  # "... number for {key} is: " just before the value


def whose(prediction: str, reference: str, document: str) -> str:
    """Where `prediction`'s number lies in `document`: another needle's key and position, or that it is absent."""
    asked = document.find(reference)
    for digits in re.findall(DIGITS, prediction):
        at = document.find(digits)
        if digits != reference and at >= 0:
            key = re.findall(KEY, document[max(0, at - 80):at])
            return (f"{key[-1] if key else 'another'}'s at {100 * at / len(document):.0f}% "
                    f"(asked at {100 * asked / len(document):.0f}%)")
    return "a number not in the document"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from hf_kvcompress.eval.tasks import build_samples
    from hf_kvcompress.models import ensure_converted

    records = [json.loads(line) for line in (Path(args.folder) / "results.jsonl").read_text().splitlines() if line]
    by_method: dict[str, dict[str, dict]] = defaultdict(dict)
    for record in records:
        by_method[record["method"]][record["sample_id"]] = record
    base = by_method[BASELINE]
    answered = sorted(s for s, r in base.items() if r["correct"])
    if not answered:
        raise SystemExit(f"{args.folder}: no {BASELINE} record answers: nothing to lose")
    first = base[answered[0]]
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(first["model"]))
    tasks = sorted({base[s]["task"] for s in answered})
    cells = {(r["length"], r["depth"]) for r in base.values()}
    per_cell = max(r["index"] for r in base.values()) + 1  # indices of a half interleave: enough to hold them all
    samples = {row["sample_id"]: row for row in build_samples(
        tokenizer, tasks, sorted({length for length, _ in cells}), sorted({depth for _, depth in cells}),
        samples_per_cell=per_cell, seed=first["seed"], split=first["split"])}
    for method, rows in by_method.items():
        if method == BASELINE:
            continue
        paired = [s for s in answered if s in rows]
        lost = [s for s in paired if not rows[s]["correct"]]
        print(f"{method}: keeps {len(paired) - len(lost)} of {len(paired)}")
        for sample_id in lost:
            record, row = rows[sample_id], samples.get(sample_id)
            reference = record["references"][0]
            where = whose(record["prediction"], reference, row["document"]) if row else "(sample not rebuilt)"
            print(f"    {sample_id}: asked {reference}, answered {record['prediction']!r}: {where}")


if __name__ == "__main__":
    main()
