"""Decode steps of KVzip's per-head-budget layers on the embedded model, without paying the reconstruction each time.

Question: how long does a decode step of `kvzip:ratio=0.25` (per-head budgets) take against DynamicCache's, and
where does its time go, measured on one saved prefill so that every version of the code decodes the same state?
Command:
    python benchmarks/probes/kvzip_head_decode.py --save /tmp/kvzip4k.safetensors [--tokens 4096] [--batch 1]
        [--spec kvzap:ratio=0.25] [--dtype bfloat16]   (--load and --dynamic take the same --dtype)
    python benchmarks/probes/kvzip_head_decode.py --load /tmp/kvzip4k.safetensors [--steps 16] [--repeats 3] [--profile]
    python benchmarks/probes/kvzip_head_decode.py --dynamic [--tokens 4096] [--batch 1] [--steps 16] [--repeats 3]
Written up: docs/benchmark-notes.md section 8 ("kvzip:ratio=0.25 decode: eviction in blocks, a cheaper per-head
view").

KVzip's prefill runs a reconstruction pass (about two minutes at 4k tokens on one core), while the decode steps
it is meant to speed up take a fraction of a second: `--save` prefills once and saves the cache (`save_cache`),
`--load` times decode steps of copies of it (process CPU time, after two warm-up steps), so one prefill serves
every version of the code (the saved state is the same). `--dynamic` times DynamicCache on the same prompt.
`--profile` prints cProfile's top entries by cumulative time over the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import time

import torch

from hf_kvcompress import load_cache, load_model, make_cache, save_cache, use_kvcompress_attention
from hf_kvcompress.generation import prefill, repeat_prompt_ids
from hf_kvcompress.hf.compat import cache_kwargs

SPEC = "kvzip:ratio=0.25"


def _prompt(tokenizer, tokens: int, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(tokens * 31 + batch)  # as bench.py draws it
    return torch.randint(100, min(tokenizer.vocab_size, 20000), (batch, tokens + 1), generator=generator)


def _decode(model, cache, token, steps: int, profile: bool) -> float:
    """Mean CPU milliseconds per step over `steps` greedy steps after two warm-up steps."""
    with torch.inference_mode():
        for _ in range(2):
            token = model(input_ids=token, use_cache=True, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        profiler = cProfile.Profile() if profile else None
        start = time.process_time()
        if profiler:
            profiler.enable()
        for _ in range(steps):
            token = model(input_ids=token, use_cache=True, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        if profiler:
            profiler.disable()
        elapsed = time.process_time() - start
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
    return 1000 * elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", help="prefill with --spec and save the cache here")
    mode.add_argument("--load", help="time decode steps of the cache saved here")
    mode.add_argument("--dynamic", action="store_true", help="time DynamicCache on the same prompt")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--spec", default=SPEC, help="a per-head-budget spec (kvzip, kvzap); default " + SPEC)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    model, tokenizer = load_model(None, dtype=args.dtype)
    use_kvcompress_attention(model)
    if args.save:
        ids = _prompt(tokenizer, args.tokens, args.batch)
        cache = make_cache(args.spec, model.config)
        with torch.inference_mode():
            prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=repeat_prompt_ids(tokenizer))
        save_cache(cache, args.save)
        torch.save(ids[:, -1:], args.save + ".token")
        print(json.dumps({"saved": args.save, "kept": cache.stored_tokens}))
        return
    times = []
    if args.load:
        saved = load_cache(args.load, model=model)
        token = torch.load(args.save or args.load + ".token")
        for _ in range(args.repeats):
            times.append(_decode(model, copy.deepcopy(saved), token, args.steps, args.profile))
    else:
        ids = _prompt(tokenizer, args.tokens, args.batch)
        for _ in range(args.repeats):
            cache = make_cache("dynamic", model.config)
            with torch.inference_mode():
                prefill(model, ids[:, :-1], None, cache)
            times.append(_decode(model, cache, ids[:, -1:], args.steps, args.profile))
    print(json.dumps({"ms_per_step": [round(t, 1) for t in times], "median": round(statistics.median(times), 1)}))


if __name__ == "__main__":
    main()
