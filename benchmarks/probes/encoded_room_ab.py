"""What the encoded store's room saves a decode step, in one process: its steps interleaved with the copying store's.

Question: how much of a decode step does writing the newly encoded tokens into the room's spare slots save against
copying the whole store at every encoding step (the store before session 29), on the user's path (plain forward
steps of the model with a cache from `make_cache`), where two processes a few minutes apart differ by more than that
on a shared machine?
Command:
    python benchmarks/probes/encoded_room_ab.py --specs "fp8;lowrank:ratio=0.5;lowrank" --tokens 4096 \\
        --steps 32 --dtype float32
Written up: docs/speed.md, "The encoded store grows in place (issues 29 and 30, session 29)".

One model (the embedded SmolLM2 by default), two caches of each spec prefilled with the same random prompt: one
with rooms, one whose every room grows to exactly the tokens it must hold (`encoded_room.grown_capacity` patched
while its steps run), which copies the store at every encoding step as `torch.cat` did. Their decode steps alternate
(room, copying, room, ...), each timed on the process's CPU clock (`time.process_time`, one thread: what other
processes disturb least); the figure is the median step of each, and the greedy tokens of both are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.caches import encoded_room
from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.compat import cache_kwargs


def _copying_capacity(needed: int, block: int) -> int:
    return needed


def run(model, spec: str, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """(median ms per step with rooms, median ms per step copying) over `steps` alternating decode steps."""
    grown = encoded_room.grown_capacity
    caches = {"room": make_cache(spec, model.config), "copy": make_cache(spec, model.config)}
    tokens = {}
    for name, cache in caches.items():
        prefill(model, ids[:, :-1], None, cache)
        tokens[name] = ids[:, -1:]
    times: dict[str, list[float]] = {"room": [], "copy": []}
    for _ in range(steps):
        for name, cache in caches.items():
            encoded_room.grown_capacity = grown if name == "room" else _copying_capacity
            try:
                start = time.process_time()
                logits = model(input_ids=tokens[name], use_cache=True, **cache_kwargs(cache)).logits
                times[name].append(time.process_time() - start)
            finally:
                encoded_room.grown_capacity = grown
            tokens[name] = logits[:, -1:].argmax(-1)
        if not torch.equal(tokens["room"], tokens["copy"]):
            raise AssertionError(f"{spec}: the room's and the copying store's greedy tokens differ")
    return 1000 * statistics.median(times["room"]), 1000 * statistics.median(times["copy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path")
    parser.add_argument("--specs", default="fp8;lowrank:ratio=0.5;lowrank", help="cache specs separated by ';'")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each cache")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype=args.dtype)
    generator = torch.Generator().manual_seed(args.tokens)
    ids = torch.randint(100, 20000, (1, args.tokens + 1), generator=generator)
    print(f"{args.model}, {args.dtype}, {args.tokens} tokens, batch 1, {args.steps} alternating steps each")
    print("| spec | room ms/step | copying ms/step | saved |")
    print("|---|---:|---:|---:|")
    with torch.inference_mode():
        for spec in args.specs.split(";"):
            room, copying = run(model, spec, ids, args.steps)
            print(f"| `{spec}` | {room:.1f} | {copying:.1f} | {100 * (1 - room / copying):.1f}% |", flush=True)


if __name__ == "__main__":
    main()
