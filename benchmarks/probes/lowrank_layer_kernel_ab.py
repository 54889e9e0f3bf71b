"""A low-rank decode step of this checkout's package beside another commit's, in one process: the steps interleaved.

Question: on the user's path (plain forward steps of the model with a cache from `make_cache`), how much faster is a
float32 (or bfloat16) decode step of a joint low-rank cache with this checkout's attention than with BASE's, where two
processes minutes apart differ by more than that on a shared machine? And where does each side's step go?
Command:
    python benchmarks/probes/lowrank_layer_kernel_ab.py --base BASE --specs "lowrank:ratio=0.5;lowrank" \
        --tokens 4096 --steps 24 --dtype float32      # BASE: a `git archive` of the other commit, extracted
Written up: docs/speed.md, "Low rank's decode step: the layer in one kernel call (issue 30, session 31; helper i30s)".

BASE's package is copied into a temporary folder as `hf_kvcompress_base` (the package imports itself relatively) and
imported beside this one; the model is this package's `load_model`. Both register the same attention function, which
calls the cache layer's own `attend`, so each cache runs its own package's code. One cache per side and
transformers' DynamicCache are prefilled with the same random prompt; their decode steps alternate, each timed on the
process's CPU clock (`time.process_time`, one thread). Printed: each side's median step (and its ratio to
DynamicCache's), how many steps both sides chose the same greedy token, and each side's median per step of the calls
it makes (wrapped): `update` (the cache's), `attend` (attention and the step's encoding), `_compress` (the encoding)
and the C++ kernel's call (`lowrank_decode_attention`, or `lowrank_store_partials` in packages before it).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.compat import cache_kwargs

KERNELS = ("lowrank_decode_attention", "lowrank_store_partials")  # the first a package has is its step's kernel


def _wrap(owner, name: str, label: str, spent: dict[str, float]) -> None:
    """Add the process time of every call of owner.name to spent[label]."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.process_time() - start

    setattr(owner, name, timed)


def _instrument(package: str, spent: dict[str, float]) -> None:
    layer = importlib.import_module(f"{package}.caches.layer").CompressedLayer
    for name in ("update", "attend", "_compress"):
        _wrap(layer, name, name, spent)
    ops = importlib.import_module(f"{package}.ops.cpu_decode")
    _wrap(ops, next(name for name in KERNELS if hasattr(ops, name)), "kernel", spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="a folder holding the other commit's hf_kvcompress package")
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path")
    parser.add_argument("--specs", default="lowrank:ratio=0.5;lowrank", help="cache specs separated by ';'")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=24, help="decode steps of each cache")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    source = Path(args.base) / "hf_kvcompress"
    if not (source / "__init__.py").exists():
        raise SystemExit(f"--base must hold an hf_kvcompress package, got {args.base!r}")
    folder = Path(tempfile.mkdtemp())
    shutil.copytree(source, folder / "hf_kvcompress_base")
    sys.path.insert(0, str(folder))
    base = importlib.import_module("hf_kvcompress_base")
    spent: dict[str, float] = {}
    _instrument("hf_kvcompress", spent)
    _instrument("hf_kvcompress_base", spent)
    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype=args.dtype)
    generator = torch.Generator().manual_seed(args.tokens)
    ids = torch.randint(100, 20000, (1, args.tokens + 1), generator=generator)
    print(f"{args.model}, {args.dtype}, {args.tokens} tokens, batch 1, {args.steps} alternating steps each")
    for spec in args.specs.split(";"):
        caches = {"base": base.make_cache(spec, model.config), "this": make_cache(spec, model.config),
                  "dynamic": DynamicCache()}
        tokens, times = {}, {name: [] for name in caches}
        parts: dict[str, list[dict[str, float]]] = {name: [] for name in caches}
        same = 0
        with torch.inference_mode():
            for name, cache in caches.items():
                prefill(model, ids[:, :-1], None, cache)
                tokens[name] = ids[:, -1:]
            for _ in range(args.steps):
                for name, cache in caches.items():
                    spent.clear()
                    start = time.process_time()
                    logits = model(input_ids=tokens[name], use_cache=True, **cache_kwargs(cache)).logits
                    times[name].append(time.process_time() - start)
                    parts[name].append(dict(spent))
                    tokens[name] = logits[:, -1:].argmax(-1)
                same += int(torch.equal(tokens["base"], tokens["this"]))
        median = {name: 1000 * statistics.median(t) for name, t in times.items()}
        print(f"`{spec}`: " + ", ".join(f"{name} {ms:.1f} ms ({ms / median['dynamic']:.2f}x)"
                                        for name, ms in median.items()) + f"; same token {same}/{args.steps}")
        for name in ("base", "this"):
            labels = sorted({label for step in parts[name] for label in step})
            print(f"    {name}: " + ", ".join(
                f"{label} {1000 * statistics.median(step.get(label, 0.0) for step in parts[name]):.1f} ms"
                for label in labels))
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
