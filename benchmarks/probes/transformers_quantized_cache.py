"""transformers' own QuantizedCache (quanto and HQQ backends, int2 and int4, and its fp8) on the suite's prompts.

Question: how do transformers' own QuantizedCache backends score on the suite's prompts, beside our caches?
Command:
    python benchmarks/probes/transformers_quantized_cache.py [--model smollm2-135m] [--tasks needle]
        [--lengths 2000] [--depths 0,50,100] [--samples 1] [--venv ~/.cache/hf-kvcompress/bench-quantized-venv]
        [--out results/transformers-quantized]
Written up: docs/results.md, "Beside transformers' own QuantizedCache"; its environment is the bench's
(docs/benchmark-notes.md section 11).

The backends need `optimum-quanto` and `hqq`, which are not dependencies of this package, so the script creates a
separate virtual environment (`--venv`) with the same torch and transformers versions and installs them there. This
process builds the prompts with the suite's own code (needle, question after the document) and scores the answers
with the suite's metric; a child process in that environment loads the model from the folder `load_model` converted
it to, prefills the document into the cache, then answers greedily, as `hf-kvcompress eval` does. A backend that
does not install or does not run is reported with its error instead of a score. transformers refuses QuantizedCache
on models with sliding-window layers (Gemma-3), and says so.

Besides the printed summary, `OUT/results.jsonl` holds one record per (configuration, sample) in the form
`hf-kvcompress eval` writes (methods named `transformers-<config>`), so `benchmarks/probes/retention_table.py OURS OUT`
puts them in one table with our caches on the same prompts (retention against our `dynamic`; the
`transformers-dynamic` row shows that transformers' own DynamicCache answers the same samples). Bytes are not
measured for the backends (their quantized tensors are the backends' own objects).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "harness"))  # the environment is the bench's

from peer_envs import QUANTIZED_VENV, build_quantized_venv  # noqa: E402

CONFIGS = {  # name -> QuantizedCache keyword arguments (None: DynamicCache, the baseline)
    "dynamic": None,
    "quanto-int4": {"backend": "quanto", "nbits": 4},
    "quanto-int2": {"backend": "quanto", "nbits": 2},
    "hqq-int4": {"backend": "hqq", "nbits": 4, "axis_key": 1, "axis_value": 1},
    "hqq-int2": {"backend": "hqq", "nbits": 2, "axis_key": 1, "axis_value": 1},
    "fp8": {"backend": "fp8"},
}


def _child(job_path: str) -> None:
    """Runs inside the benchmark's environment: only torch, transformers and the backends are imported here."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache

    job = json.loads(Path(job_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    results = []
    for name in job["configs"]:
        kwargs = CONFIGS[name]
        for sample in job["samples"]:
            record = {"config": name, "id": sample["id"]}
            try:
                if kwargs is None:
                    cache = DynamicCache(config=model.config)
                else:
                    cache = QuantizedCache(config=model.config, **kwargs)
                document = torch.tensor([sample["document"]])
                full = torch.tensor([sample["document"] + sample["question"]])
                start = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=document, cache=cache, use_cache=True)
                    out = model.generate(input_ids=full, attention_mask=torch.ones_like(full), cache=cache,
                                         max_new_tokens=sample["max_new_tokens"], do_sample=False)
                record["new_tokens"] = out[0, full.shape[1]:].tolist()
                record["seconds"] = time.perf_counter() - start
            except Exception as error:  # reported per configuration: the point is to say what failed
                frame = traceback.extract_tb(error.__traceback__)[-1]
                where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} {frame.name}"
                record["error"] = f"{type(error).__name__}: {error} (at {where})"
            results.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "new_tokens"}), flush=True)
    Path(job["out"]).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="needle", help="comma-separated suite tasks")
    parser.add_argument("--lengths", "--length", default="2000", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--depths", default="0,50,100")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--venv", default=str(QUANTIZED_VENV))
    parser.add_argument("--out", default="results/transformers-quantized")
    args = parser.parse_args()
    if args.child:
        return _child(args.child)

    from transformers import AutoTokenizer

    from hf_kvcompress.eval.prompts import encode
    from hf_kvcompress.eval.scoring import score_all
    from hf_kvcompress.eval.tasks import build_samples
    from hf_kvcompress.models import ensure_converted, load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_converted(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    layer_types = set(getattr(load_config(args.model).get_text_config(decoder=True), "layer_types", None) or [])
    if layer_types - {"full_attention"}:
        print(f"{args.model} has {sorted(layer_types)} layers: transformers' QuantizedCache accepts only full "
              "attention")
    depths = [float(d) for d in args.depths.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    samples = build_samples(tokenizer, args.tasks.split(","), lengths, depths, samples_per_cell=args.samples)
    rows = []
    for sample in samples:
        document, question = encode(tokenizer, sample)
        rows.append({"id": sample["sample_id"], "document": document, "question": question, "depth": sample["depth"],
                     "task": sample["task"], "length": sample["length"],
                     "max_new_tokens": sample["max_new_tokens"], "references": sample["references"]})
    configs = args.configs.split(",")
    failed = build_quantized_venv(Path(args.venv), out / "pip.log")
    runnable = [c for c in configs if CONFIGS[c] is None or CONFIGS[c]["backend"] not in failed]
    job = {"model_dir": str(model_dir), "configs": runnable, "samples": rows, "out": str(out / "predictions.json")}
    (out / "job.json").write_text(json.dumps(job))
    subprocess.run([str(Path(args.venv) / "bin" / "python"), __file__, "--child", str(out / "job.json")], check=True)
    results = json.loads((out / "predictions.json").read_text())
    by_id = {row["id"]: row for row in rows}
    table = {}
    with (out / "results.jsonl").open("w") as sink:
        for record in results:
            row = by_id[record["id"]]
            if "error" in record:
                table.setdefault(record["config"], {"errors": set()}).setdefault("errors", set()).add(record["error"])
                continue
            text = tokenizer.decode(record["new_tokens"], skip_special_tokens=True)
            score = score_all([text], [row["references"]])["string_match_all"][0]
            cell = table.setdefault(record["config"], {})
            cell.setdefault(row["depth"], []).append(score)
            sink.write(json.dumps({
                "method": f"transformers-{record['config']}", "model": args.model, "sample_id": row["id"],
                "task": row["task"], "length": row["length"], "depth": row["depth"], "score": score,
                "correct": score >= 100.0, "prediction": text, "references": row["references"],
            }) + "\n")
    print(f"\n{args.model}, {args.tasks}, {args.lengths} tokens, {args.samples} sample(s) per depth; string_match_all")
    for config in configs:
        if config not in runnable:
            print(f"{config:12s} not run: {failed[CONFIGS[config]['backend']]}")
            continue
        cell = table.get(config, {})
        for error in sorted(cell.pop("errors", set())):
            print(f"{config:12s} failed: {error[:300]}")
        scores = [s for depth in sorted(cell) for s in cell[depth]]
        if scores:
            per_depth = " / ".join(f"{sum(cell[d]) / len(cell[d]):.0f}" for d in sorted(cell))
            print(f"{config:12s} score {sum(scores) / len(scores):5.1f} (n={len(scores)})  by depth {per_depth}")


if __name__ == "__main__":
    main()
