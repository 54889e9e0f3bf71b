"""The cache's own share of a decode step: every layer's `update` plus our attention function, without the model.

Question: how long does each cache's part of a decode step take against DynamicCache's, with the model's weights
(the same for every cache) left out, and how many host reads (GPU syncs) does a step make?
Command:
    python benchmarks/probes/decode_step.py [--tokens 4096] [--batch 1] [--steps 16] [--repeats 5]
        [--specs "int4;fp8"] [--layers 30] [--clock wall|cpu] [--model smollm2-135m] [--dtype float32]
        [--warmup 0]
Written up: docs/benchmark-notes.md, the cache-only tables of "Baseline" and sections 5, 7, 10 and 12; docs/speed.md,
"KVzap's decode step without a copy of its pairs".

The model's weights cost the same with every cache, so their time only dilutes the ratios; this isolates what
the caches change, on the embedded model's shapes (30 layers, 9 query heads on 3 KV heads of 64 dims, float32).
`--model` builds the caches with that model's config instead (its calibrations load: `lowrank` needs its bases;
the shapes must be the embedded model's), without its weights; `--dtype` the states' dtype. A cache that scores
tokens from their hidden states (`kvzap`, which needs `--model`: its probe is the model's) is handed random ones, as
the hooks of `use_kvcompress_attention` hand the real ones.
Each cache is filled with random states of `--tokens` tokens (prefilled in chunks of 512, as our prefill does),
then decodes `--warmup` steps untimed (KVzap ranks the prompt at the first decode step and confirms its fused
path there) and `--steps` timed ones; the figure is the median over interleaved repeats of the mean step time, with the
host reads of tensor values (syncs on a GPU) per decode step. On a shared machine use `--clock cpu` with
OMP_NUM_THREADS=1: the process's CPU time does not count the time other processes hold the cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress import make_cache
from hf_kvcompress.caches.requests import HIDDEN_KEY
from hf_kvcompress.hf.attention import kvcompress_attention
from hf_kvcompress.ops.host_syncs import HostSyncCounter

SPECS = [
    "dynamic", "int8", "int4", "int2", "fp8", "sink_window:sink_tokens=4,window=1020",
    "h2o:budget=1024,recent=128", "snapkv:budget=1024",
]


class _Module:
    """What attention functions read from the attention module."""

    def __init__(self, layer_idx: int, groups: int):
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, groups, True


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=layers,
        intermediate_size=1536, vocab_size=256,
    )


def _step(cache, modules, states, queries, position: torch.Tensor, hidden: torch.Tensor | None = None):
    """One forward's cache work: every layer's `update` and attention. `hidden` [B, >= new, hidden_size]: the
    hidden states handed to a cache that scores from them."""
    new = queries.shape[2]
    for i in range(len(modules)):
        kwargs = {"position_ids": position}
        if hidden is not None and getattr(cache, "reads_hidden_states", False):
            kwargs[HIDDEN_KEY] = hidden[:, :new]
        k, v = cache.update(states[0][..., :new, :], states[1][..., :new, :], i, kwargs)
        mask = None
        if new > 1:  # causal over the new tokens, everything before them visible
            kv = k.shape[-2]
            mask = torch.ones(new, kv, dtype=torch.bool).tril(kv - new)[None, None]
        kvcompress_attention(modules[i], queries, k, v, mask, scaling=64 ** -0.5, **kwargs)


@torch.inference_mode()
def run(spec: str, tokens: int, batch: int, steps: int, layers: int, clock=time.perf_counter, config=None,
        dtype: torch.dtype = torch.float32, warmup: int = 0) -> tuple[float, float]:
    """Mean ms per decode step and host reads per decode step (`config`: the caches' model config, default
    `_config(layers)`), over `steps` steps after `warmup` untimed ones."""
    gen = torch.Generator().manual_seed(0)
    config = config if config is not None else _config(layers)
    cache = make_cache(spec, config)
    modules = [_Module(i, 3) for i in range(layers)]
    chunk = 512
    states = (torch.randn(batch, 3, chunk, 64, generator=gen).to(dtype),
              torch.randn(batch, 3, chunk, 64, generator=gen).to(dtype))
    width = getattr(config, "hidden_size", 576)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        position = torch.arange(start, start + n)[None].expand(batch, n)
        hidden = torch.randn(batch, n, width, generator=gen).to(dtype)
        _step(cache, modules, states, torch.randn(batch, 9, n, 64, generator=gen).to(dtype), position, hidden)
    query = torch.randn(batch, 9, 1, 64, generator=gen).to(dtype)
    hidden = torch.randn(batch, 1, width, generator=gen).to(dtype)
    for s in range(warmup):
        _step(cache, modules, states, query, torch.full((batch, 1), tokens + s), hidden)
    counter = HostSyncCounter()
    begin = clock()
    for s in range(warmup, warmup + steps):
        position = torch.full((batch, 1), tokens + s)
        if s == warmup + steps - 1:
            with counter:
                _step(cache, modules, states, query, position, hidden)
        else:
            _step(cache, modules, states, query, position, hidden)
    return 1000 * (clock() - begin) / steps, counter.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--specs", default=";".join(SPECS))
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time or process CPU time")
    parser.add_argument("--model", default=None, help="build the caches with this model's config (an alias)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--warmup", type=int, default=0, help="untimed decode steps before the timed ones")
    args = parser.parse_args()
    config = None
    if args.model is not None:
        from hf_kvcompress.models import load_config

        config = load_config(args.model)
        args.layers = config.num_hidden_layers
    specs = ["dynamic"] + [s for s in args.specs.split(";") if s and s != "dynamic"]
    times = {s: [] for s in specs}
    syncs = {}
    for _ in range(args.repeats):
        for spec in specs:
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            ms, syncs[spec] = run(spec, args.tokens, args.batch, args.steps, args.layers, clock, config,
                                  getattr(torch, args.dtype), args.warmup)
            times[spec].append(ms)
    base = statistics.median(times["dynamic"])
    print(f"{args.tokens} tokens, batch {args.batch}, {args.layers} layers, {args.steps} steps, median of "
          f"{args.repeats}, {args.dtype}, torch threads {torch.get_num_threads()}, clock {args.clock}")
    print(f"{'cache':42s} {'ms/step':>8s} {'x dynamic':>9s} {'host reads/step':>15s}")
    for spec in specs:
        ms = statistics.median(times[spec])
        print(f"{spec:42s} {ms:8.2f} {ms / base:9.2f} {syncs[spec]:15d}")


if __name__ == "__main__":
    main()
