"""How fast can an evicting cache decode at best: a DynamicCache that holds only the kept tokens, beside the caches.

Question: a cache that keeps a quarter of a 4k prompt should decode like a DynamicCache of 1k tokens (what kvpress's
SnapKV is after it compresses the prompt). How far is each cache from that floor, in the same process, on the user's
path (`model(input_ids=token, cache=...)` steps after our `prefill`), and where does its decode step go?
Command:
    python benchmarks/probes/eviction_floor.py [--runs "dynamic@1024;dynamic@4096;snapkv:ratio=0.25@4096"]
        [--dtype float32|bfloat16] [--steps 16] [--repeats 1] [--profile "snapkv:ratio=0.25@4096"]
Written up: docs/speed.md, "SnapKV decodes like a cache of the kept tokens (issue 29, session 18)".

Each run is `SPEC@TOKENS`: `dynamic` is transformers' DynamicCache, anything else a spec of ours. Every run decodes
after the last TOKENS tokens of the same 4096-token prompt (bench_measure.prompt_ids), so `dynamic@1024` holds what
a cache that keeps the newest quarter would; the model runs 'kvcompress_sdpa' for every run (it is SDPA when no cache
asks for more). The figure is the median of `--repeats` of the mean process CPU time per step over `--steps` steps
after two warm-up steps, one torch thread (on a shared machine the process's CPU time does not count the time other
processes hold the cores). `--profile RUN` also prints cProfile's top entries over that run's steps (its time then
includes the profiler's).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "harness"))  # bench_measure: the bench's prompt

PROMPT = 4096


def _cache(spec: str, config):
    import transformers

    from hf_kvcompress import make_cache

    return transformers.DynamicCache(config=config) if spec == "dynamic" else make_cache(spec, config)


def _run(model, tokenizer, run: str, steps: int, profile: bool) -> tuple[float, int]:
    """Mean CPU ms per decode step of `run` (SPEC@TOKENS) and the tokens its cache holds after them."""
    from bench_measure import prefilled_decoder, prompt_ids

    spec, tokens = run.rsplit("@", 1)
    ids = prompt_ids(tokenizer.vocab_size, PROMPT, 1)[:, -(int(tokens) + 1):]
    cache = _cache(spec, model.config)
    decode = prefilled_decoder(model, tokenizer, cache, ids)
    decode(2)
    profiler = cProfile.Profile() if profile else None
    start = time.process_time()
    if profiler:
        profiler.enable()
    decode(steps)
    if profiler:
        profiler.disable()
    elapsed = time.process_time() - start
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
    kept = cache.get_seq_length() if spec == "dynamic" else cache.stored_tokens
    return 1000 * elapsed / steps, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="dynamic@1024;dynamic@4096;snapkv:ratio=0.25@4096",
                        help="SPEC@TOKENS runs separated by ';' (dynamic: transformers' DynamicCache)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--profile", default="", help="a run of --runs to profile (cProfile) as well")
    args = parser.parse_args()
    from hf_kvcompress import load_model, use_kvcompress_attention

    torch.set_num_threads(1)
    model, tokenizer = load_model(None, dtype=args.dtype)
    use_kvcompress_attention(model)
    runs = [r for r in args.runs.split(";") if r]
    times: dict[str, list[float]] = {run: [] for run in runs}
    kept = {}
    with torch.inference_mode():
        model(input_ids=torch.arange(100, 116)[None], use_cache=False)  # warm-up
        for _ in range(args.repeats):
            for run in runs:
                ms, kept[run] = _run(model, tokenizer, run, args.steps, run == args.profile)
                times[run].append(ms)
    base = f"dynamic@{PROMPT}"
    reference = statistics.median(times[base]) if base in times else None
    print(f"{args.dtype}, {args.steps} steps, median of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'run':50s} {'kept':>6s} {'ms/step':>8s} {'x ' + base:>14s}")
    for run in runs:
        ms = statistics.median(times[run])
        ratio = f"{ms / reference:14.2f}" if reference else ""
        print(f"{run:50s} {kept[run]:6d} {ms:8.2f} {ratio}")


if __name__ == "__main__":
    main()
