"""How one bench run measures, shared by bench.py's worker and the peers' worker (bench_peer_worker.py).

Imports only torch: the peers' worker runs in other virtual environments, without hf_kvcompress. Whatever both
workers must do alike lives here: the clock, the peak resident memory, the random prompt, the bytes a cache holds.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import threading
import time
from pathlib import Path

import torch


def clock(name: str):
    """`cpu`: this process's CPU time (what other processes on a shared machine disturb least); `wall`: wall time."""
    return time.process_time if name == "cpu" else time.perf_counter


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The largest resident set seen while active, sampled every millisecond (ru_maxrss cannot be reset)."""

    def __init__(self):
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def prompt_ids(vocab_size: int, length: int, batch: int) -> torch.Tensor:
    """The run's prompt, [batch, length + 1] token ids: the same for every cache at a (length, batch) and every torch
    that draws alike (the environments share torch's version); the last column is the first decode step's input."""
    generator = torch.Generator().manual_seed(length * 31 + batch)
    return torch.randint(100, min(vocab_size, 20000), (batch, length + 1), generator=generator)


def timed_run(model, ids: torch.Tensor, prefill, step, new_tokens: int, clock_name: str) -> dict:
    """What both workers measure, one way: a warm-up forward, then `prefill(prompt)` and `new_tokens` greedy steps
    (`step(token, i)` returns the model's output for decode step i), each timed on `clock_name`, with the peak resident
    memory of each above the level before prefill. `ids` is `prompt_ids`: the prompt, then the first step's input."""
    tick = clock(clock_name)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], use_cache=False)  # warm-up: the weights become resident, kernels initialise
        baseline = rss()
        with PeakSampler() as prefill_peak:
            start = tick()
            prefill(ids[:, :-1])
            prefill_s = tick() - start
        token = ids[:, -1:]
        with PeakSampler() as decode_peak:
            start = tick()
            for i in range(new_tokens):
                token = step(token, i).logits[:, -1:].argmax(-1)
            decode_s = tick() - start
    return {
        "prefill_s": prefill_s,
        "decode_ms": 1000 * decode_s / new_tokens,
        "prefill_peak": prefill_peak.peak - baseline,
        "decode_peak": decode_peak.peak - baseline,
        "process_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def prefilled_decoder(model, tokenizer, cache, ids: torch.Tensor):
    """Prefill `cache` with `ids[:, :-1]` (`hf_kvcompress.prefill`, which runs KVzip's reconstruction pass for a cache
    that scores by it) and return `decode(n)`: n greedy steps of `model` from `ids[:, -1:]`, each feeding the token
    the last one chose, under torch's inference mode as the caller holds it. For the probes in our own environment
    (the package is imported here, not at the module's top: the peers' workers load this module without it)."""
    from hf_kvcompress.generation import prefill, repeat_prompt_ids
    from hf_kvcompress.hf.compat import cache_kwargs

    prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=repeat_prompt_ids(tokenizer))
    token = ids[:, -1:]

    def decode(n: int) -> None:
        nonlocal token
        for _ in range(n):
            token = model(input_ids=token, use_cache=True, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)

    return decode


def _package_measure():
    """hf_kvcompress/measure.py, loaded by path: it imports only torch, so it runs where the package is not
    installed."""
    path = Path(__file__).resolve().parents[2] / "hf_kvcompress" / "measure.py"  # from benchmarks/harness/
    spec = importlib.util.spec_from_file_location("_hf_kvcompress_measure", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_bytes(cache) -> int:
    """Bytes of tensor storage a cache holds, each storage counted once, by `hf_kvcompress.measured_kv_bytes` itself
    (a kept slice of a larger buffer pins the whole buffer; a wrapper tensor subclass such as quanto's counts its
    parts), for caches that are not ours: transformers' QuantizedCache and the DynamicCache that kvpress compressed."""
    return _package_measure().measured_kv_bytes(cache)
