"""Bytes and decode speed of every cache on the embedded model, as ratios to DynamicCache measured in the same run.

    python benchmarks/cache_speed_memory.py [--prompt-tokens 3000] [--new-tokens 32] [--repeats 3]

Each method prefills the same prompt, then decodes greedily; decode time is the median over repeats, with
methods interleaved so that machine load affects them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress import load_model, make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.compat import cache_kwargs
from hf_kvcompress.registry import bounds_memory

SPECS = [
    "dynamic", "int8", "int4", "int2", "fp8",
    "sink_window:sink_tokens=4,window=1024", "h2o:budget=1024,recent=128",
    "sink_window:sink_tokens=4,window=1024+int4", "h2o:budget=1024,recent=128+int8",
]
TEXT = (
    "The KV cache stores a key and a value vector per token, per layer and per KV head. For long prompts and many "
    "users it, not the weights, limits memory and decode speed. Quantization, eviction, head sharing and low-rank "
    "compression each shrink one factor of its size. "
)


@torch.inference_mode()
def decode_ms_per_token(model, ids, spec, new_tokens):
    cache = make_cache(spec, model.config)
    prefill(model, ids[:, :-1], None, cache, chunk_size=512 if bounds_memory(spec) else None)
    token = ids[:, -1:]
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, use_cache=True, **cache_kwargs(cache))
        token = out.logits[:, -1:].argmax(-1)
    elapsed = time.perf_counter() - start
    return 1000 * elapsed / new_tokens, measured_kv_bytes(cache), cache.stored_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--specs", default=";".join(SPECS), help="cache specs separated by ;")
    args = parser.parse_args()
    specs = args.specs.split(";")
    model, tokenizer = load_model(args.model)
    use_kvcompress_attention(model)
    ids = tokenizer(TEXT * (args.prompt_tokens // 40 + 1), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    ids = ids.to(model.device)
    times = {spec: [] for spec in specs}
    memory = {}
    for _ in range(args.repeats):
        for spec in specs:
            ms, nbytes, kept = decode_ms_per_token(model, ids, spec, args.new_tokens)
            times[spec].append(ms)
            memory[spec] = (nbytes, kept)
    base_ms = statistics.median(times["dynamic"])
    base_bytes = memory["dynamic"][0]
    print(f"{args.prompt_tokens}-token prompt, {args.new_tokens} decoded tokens, median of {args.repeats}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'cache':45s} {'KV bytes':>12s} {'x dynamic':>9s} {'kept':>6s} {'ms/token':>9s} {'x dynamic':>9s}")
    for spec in specs:
        nbytes, kept = memory[spec]
        ms = statistics.median(times[spec])
        print(f"{spec:45s} {nbytes:12,d} {nbytes / base_bytes:9.3f} {kept:6d} {ms:9.1f} {ms / base_ms:9.2f}")


if __name__ == "__main__":
    main()
