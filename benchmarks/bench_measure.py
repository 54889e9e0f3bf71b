"""How one bench run measures, shared by bench.py's worker and the peers' worker (bench_peer_worker.py).

Imports only torch: the peers' worker runs in other virtual environments, without hf_kvcompress. Whatever both
workers must do alike lives here: the clock, the peak resident memory, the random prompt, the bytes a cache holds.
"""

from __future__ import annotations

import os
import threading
import time

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


def _leaves(tensor: torch.Tensor):
    """The plain tensors that hold a tensor's data: itself, or the parts of a wrapper subclass (quanto's QTensors
    keep their codes, scales and shifts in inner tensors; the wrapper owns no storage of its own)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield tensor
        return
    for name in flatten()[0]:
        yield from _leaves(getattr(tensor, name))


def _tensors(obj, seen: set[int]):
    """Every tensor reachable from `obj` through attributes, dicts, lists and tuples (not through modules or types)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for value in vars(obj).values():
            yield from _tensors(value, seen)


def held_bytes(cache) -> int:
    """Bytes of tensor storage a cache holds, each storage counted once, as `hf_kvcompress.measured_kv_bytes` counts
    (a kept slice of a larger buffer pins the whole buffer), for caches that are not ours: transformers' QuantizedCache
    (quanto's tensors through their parts, HQQ's and fp8's scales) and the DynamicCache that kvpress compressed."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    for root in getattr(cache, "layers", None) or [cache]:
        for tensor in _tensors(root, seen):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
