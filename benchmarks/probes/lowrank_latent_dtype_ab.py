"""What storing a float32 model's low-rank latents in bf16 saves a decode step, in one process: the stores' steps
interleaved.

Question: on the user's path (plain forward steps of the model with a cache from `make_cache`), how much faster is a
float32 decode step whose key products run in bf16 (`lowrank:compute=auto` on a CPU with AVX512-BF16) when its key
latents, or its key and value latents, are stored in bf16 instead of float32 (what the kernel reads from memory at
every step halves), where two processes a few minutes apart differ by more than that on a shared machine?
Command:
    python benchmarks/probes/lowrank_latent_dtype_ab.py --specs "lowrank:ratio=0.5;lowrank" --tokens 4096 --steps 24
Written up: docs/speed.md, "Low rank's float32 latents stored in bf16 (issue 30, session 30)".

One model (the embedded SmolLM2 by default, float32), three caches of each spec prefilled with the same random
prompt, each stored its way (`lowrank.BF16_LATENTS` set while its prefill and steps run: the kinds stored in bf16):
"key+value" (the package's choice), "key" (values float32) and "none" (float32 latents, as before session 30), and
transformers' DynamicCache as the baseline. Their decode steps alternate, each timed on the process's CPU clock
(`time.process_time`, one thread); the figure is the median step of each (and its ratio to DynamicCache's), with the
share of steps whose greedy token equals the float32 store's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.codecs import lowrank
from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.compat import cache_kwargs

VARIANTS = {"key+value": ("key", "value"), "key": ("key",), "none": ()}


def run(model, spec: str, ids: torch.Tensor, steps: int) -> dict[str, tuple[float, float]]:
    """{variant: (median ms per step, share of steps whose token equals the float32 store's)}, and "dynamic"."""
    kept = lowrank.BF16_LATENTS
    caches = {name: make_cache(spec, model.config) for name in VARIANTS}
    caches["dynamic"] = DynamicCache()
    tokens, times, agree = {}, {name: [] for name in caches}, {name: 0 for name in caches}
    try:
        for name, cache in caches.items():
            lowrank.BF16_LATENTS = VARIANTS.get(name, kept)
            prefill(model, ids[:, :-1], None, cache)
            tokens[name] = ids[:, -1:]
        for _ in range(steps):
            for name, cache in caches.items():
                lowrank.BF16_LATENTS = VARIANTS.get(name, kept)
                start = time.process_time()
                logits = model(input_ids=tokens[name], use_cache=True, **cache_kwargs(cache)).logits
                times[name].append(time.process_time() - start)
                tokens[name] = logits[:, -1:].argmax(-1)
            for name in caches:
                agree[name] += int(torch.equal(tokens[name], tokens["none"]))
    finally:
        lowrank.BF16_LATENTS = kept
    for name in VARIANTS:
        cache = caches[name]
        dtypes = {t.dtype for layer in cache.layers for e in (layer.encoded_keys, layer.encoded_values)
                  for t in e.values()}
        print(f"  {name}: latents {sorted(str(d) for d in dtypes)}", flush=True)
    return {name: (1000 * statistics.median(times[name]), agree[name] / steps) for name in caches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path")
    parser.add_argument("--specs", default="lowrank:ratio=0.5;lowrank", help="cache specs separated by ';'")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=24, help="decode steps of each cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype="float32")
    generator = torch.Generator().manual_seed(args.tokens)
    ids = torch.randint(100, 20000, (1, args.tokens + 1), generator=generator)
    print(f"{args.model}, float32, {args.tokens} tokens, batch 1, {args.steps} alternating steps each")
    rows = []
    with torch.inference_mode():
        for spec in args.specs.split(";"):
            rows.append((spec, run(model, spec, ids, args.steps)))
    print("| spec | DynamicCache ms/step | "
          + " | ".join(f"{name} ms/step (x dynamic; same token)" for name in VARIANTS) + " |")
    print("|---|---:|" + "---:|" * len(VARIANTS))
    for spec, result in rows:
        base = result["dynamic"][0]
        cells = " | ".join(f"{result[name][0]:.1f} ({result[name][0] / base:.2f}x; {result[name][1]:.0%})"
                           for name in VARIANTS)
        print(f"| `{spec}` | {base:.1f} | {cells} |")


if __name__ == "__main__":
    main()
