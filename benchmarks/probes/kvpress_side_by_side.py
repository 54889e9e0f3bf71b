"""kvpress 0.5.5's presses beside ours, on the same prompts, in the same table (issue: eviction that keeps answers).

Question: how many of the answers the uncompressed cache gets right does each kvpress press keep, with the bytes
its cache really holds, beside our eviction caches on the same prompts?
Command:
    python benchmarks/probes/kvpress_side_by_side.py --model smollm2-135m --lengths 2000 --samples 3 \\
        --out results/kvpress-smollm2 [--ours results/evict-smollm2] [--split test]
Written up: docs/results.md, "Beside kvpress on the test half" (the suite's test half, with --ours) and "Eviction
policies side by side (question after the document)" (kvpress's presses, and KVzipPress).

kvpress pins transformers < 5.3, so this script runs kvpress_worker.py (beside it) in a virtual environment of its
own, the bench's (benchmarks/.venv-kvpress, built by benchmarks/harness/peer_envs.py on first use: torch 2.13 CPU,
kvpress 0.5.5 and the transformers it accepts). The prompts are ours (document, then question, token ids as
`hf-kvcompress eval` encodes them); each press compresses the document as kvpress's pipeline does, then answers
greedily. Bytes are what kvpress's cache really holds (its head-wise presses such as KVzip mask keys and free
nothing). Scores use our metrics; retention is against the uncompressed run in the same environment. `--ours` adds
the records of an `hf-kvcompress eval` run on the same samples (same tasks, lengths, depths, samples and seed), so
both libraries share one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "harness"))  # the kvpress environment is the bench's (peer_envs.py)

from peer_envs import KVPRESS_VENV, ensure_kvpress_venv  # noqa: E402


def export_prompts(args, out: Path) -> tuple[Path, str]:
    from hf_kvcompress.eval.prompts import encode
    from hf_kvcompress.eval.tasks import build_samples, split_specs
    from hf_kvcompress.models import ensure_converted, load_model

    model_dir = ensure_converted(args.model)
    _, tokenizer = load_model(args.model)
    samples = build_samples(tokenizer, split_specs(args.tasks), args.lengths, args.depths,
                            samples_per_cell=args.samples, seed=args.seed, split=args.split)
    path = out / "prompts.jsonl"
    with path.open("w") as sink:
        for row in samples:
            document_ids, question_ids = encode(tokenizer, row)
            sink.write(json.dumps({
                "sample_id": row["sample_id"], "task": row["task"], "metric": row["metric"], "length": row["length"],
                "depth": row["depth"], "references": row["references"], "max_new_tokens": row["max_new_tokens"],
                "document_ids": document_ids, "question_ids": question_ids,
            }) + "\n")
    return path, str(model_dir)


def score(out: Path, prompts: Path, model: str) -> list[dict]:
    from hf_kvcompress.eval.scoring import score_all

    rows = {p["sample_id"]: p for p in map(json.loads, prompts.read_text().splitlines())}
    raw = [json.loads(line) for line in (out / "kvpress.jsonl").read_text().splitlines() if line.strip()]
    records = []
    for r in raw:
        if "error" in r:
            print(f"kvpress {r['press']} keep={r['keep']} failed: {r['error']}")
            continue
        row = rows[r["sample_id"]]
        value = score_all([r["prediction"]], [row["references"]])[row["metric"]][0]
        method = "dynamic" if r["press"] == "none" else f"kvpress:{r['press']}:keep={r['keep']:g}"
        records.append({"model": model, "method": method, "sample_id": r["sample_id"], "depth": row["depth"],
                        "score": value, "correct": value >= 100.0, "kv_bytes_document": r["kv_bytes"],
                        "prediction": r["prediction"]})
    return records


def same_prompts(prompts: Path, ours: list[dict], theirs: list[dict]) -> str:
    """Whether both sides ran the same prompts (sample ids and token-id digests) and what each baseline answers.

    Retention is against each side's own uncompressed run, so a baseline that answers other questions is said here
    rather than hidden in the table."""
    from hf_kvcompress.eval.runner import input_digest

    exported = {p["sample_id"]: input_digest(p["document_ids"], p["question_ids"], p["references"])
                for p in map(json.loads, prompts.read_text().splitlines())}
    ran = {r["sample_id"]: r.get("input_digest") for r in ours}
    lines = [f"prompts: {len(exported)} exported, {len(ran)} in --ours"]
    missing = sorted(set(exported) - set(ran))
    other = sorted(s for s in set(exported) & set(ran) if ran[s] != exported[s])
    lines.append(f"samples kvpress ran that --ours lacks: {missing or 'none'}")
    lines.append(f"samples whose token ids differ: {other or 'none (identical token ids)'}")
    answered = {side: {r["sample_id"] for r in rows if r["method"] == "dynamic" and r["correct"]}
                for side, rows in (("ours", ours), ("kvpress", theirs))}
    lines.append(f"uncompressed answers: ours {len(answered['ours'])}, kvpress {len(answered['kvpress'])}; "
                 f"only ours: {sorted(answered['ours'] - answered['kvpress']) or 'none'}; "
                 f"only kvpress: {sorted(answered['kvpress'] - answered['ours']) or 'none'}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="needle")
    parser.add_argument("--lengths", default="2000")
    parser.add_argument("--depths", default="0,25,50,75,100")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="test", choices=("dev", "test"), help="the half of each task's samples")
    parser.add_argument("--presses", default="snapkv,tova,streaming_llm,observed_attention,kvzip")
    parser.add_argument("--keep", default="0.5,0.25", help="shares of the document kept (kvpress ratio = 1 - keep)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ours", help="an `hf-kvcompress eval` output folder on the same samples")
    parser.add_argument("--venv", default=str(KVPRESS_VENV))
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.depths = [float(x) for x in args.depths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, model_dir = export_prompts(args, out)
    python = ensure_kvpress_venv(Path(args.venv))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours leaks into kvpress's env
    subprocess.run([str(python), str(HERE / "kvpress_worker.py"), "--model-dir", model_dir, "--prompts",
                    str(prompts), "--presses", args.presses, "--keep", args.keep,
                    "--out", str(out / "kvpress.jsonl")], check=True, env=env)
    sys.path.insert(0, str(HERE))
    from retention_table import load, table

    records = score(out, prompts, args.model)
    with (out / "results.jsonl").open("w") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in records)
    text = "kvpress 0.5.5 (its own venv; retention against its own uncompressed run)\n\n" + table(records)
    if args.ours:
        ours = load(args.ours)
        text += "\n\nhf-kvcompress on the same samples\n\n" + table([{**r, "model": args.model} for r in ours])
        text += "\n\n" + same_prompts(prompts, ours, records)
    (out / "side_by_side.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
