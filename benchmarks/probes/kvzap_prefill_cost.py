"""What KVzap's probe adds to a prefill, beside DynamicCache's and KVzip's (its reconstruction pass).

Question: how long does a prefill take with `kvzap` (each token scored by its layer's probe as it arrives; with
the default head budgets the prompt is held and every layer's pairs ranked once at the end, with
`budgets=uniform` the cache evicts to its share in the same step) compared with a DynamicCache prefill of the same
prompt, in the same run, and with `kvzip` (which reads the prompt a second time)?
Command:
    python benchmarks/probes/kvzap_prefill_cost.py --tokens 4096 --repeats 3 --specs "kvzap:ratio=0.25"
Written up: docs/results.md, "KVzap: KVzip's scores from one read".

The prompt is prose from the suite's novel (the test half's chapters; what is timed does not depend on the text),
prefilled in one call (`generation.prefill`, no chunks), the methods alternating within each repeat so a machine
shared with other work slows them alike; the median of the repeats is reported, and the ratio to DynamicCache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.data import book_words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--specs", default="kvzap:ratio=0.25", help="';'-separated cache specs beside DynamicCache")
    parser.add_argument("--kvzip", default="kvzip:ratio=0.25", help="timed once (its pass is slow); '' to skip")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    use_kvcompress_attention(model)
    ids = tokenizer(" ".join(book_words("test")), return_tensors="pt").input_ids[:, : args.tokens]
    repeat = repeat_prompt_ids(tokenizer)
    specs = ["dynamic", *filter(None, args.specs.split(";"))]

    def timed(spec: str) -> float:
        cache = DynamicCache(config=model.config) if spec == "dynamic" else make_cache(spec, model.config)
        start = time.perf_counter()
        prefill(model, ids, None, cache, repeat_prompt_ids=repeat)
        return time.perf_counter() - start

    timed("dynamic")  # warm-up
    seconds = {spec: [] for spec in specs}
    for _ in range(args.repeats):
        for spec in specs:
            seconds[spec].append(timed(spec))
    if args.kvzip:
        seconds[args.kvzip] = [timed(args.kvzip)]
    base = statistics.median(seconds["dynamic"])
    print(f"prefill of {ids.shape[1]} tokens, {model.config._name_or_path}, threads {torch.get_num_threads()}")
    print("| cache | median s | runs | x DynamicCache |")
    print("|---|---|---|---|")
    for spec, runs in seconds.items():
        median = statistics.median(runs)
        print(f"| `{spec}` | {median:.2f} | {', '.join(f'{r:.2f}' for r in runs)} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
