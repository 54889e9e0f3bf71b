"""The study's samples split between CPU worker processes, one thread each.

On a CPU, most of a plan's work after the shared prefill is small matrix products (a question of 40 tokens, then
one token per step) that a second thread barely speeds up; two processes that each take half the samples use both
cores for all of it. On a machine whose cores are also busy with other work, threads of one process wait for each
other at every product (docs/benchmark-notes.md), which single-threaded workers never do. Records come back in the
order one process would have made them.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import torch

from .models import load_model
from .shared_prefill import run_plans


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(device: str) -> int:
    """One process per core on a CPU (at most 4: each holds a copy of the model); one on a GPU."""
    return 1 if device != "cpu" else max(1, min(4, cpu_cores()))


def _share(model_name: str, plans: Sequence[str], rows: list[dict], kwargs: dict, threads: int) -> list[dict]:
    """One worker's part: load the model, run every plan on its rows."""
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name, device="cpu")
    return run_plans(model, tokenizer, plans, rows, model_name=model_name, **kwargs)


def order_records(records: list[dict], plans: Sequence[str], samples: Sequence[dict]) -> list[dict]:
    """Plan by plan in `plans` order, each plan's samples in `samples` order."""
    plan_index = {p: i for i, p in enumerate(plans)}
    sample_index = {(s["task"], s["sample_id"]): i for i, s in enumerate(samples)}
    return sorted(records, key=lambda r: (plan_index[r["method"]], sample_index[r["task"], r["sample_id"]]))


def run_plans_split(model, tokenizer, plans: Sequence[str], samples, *, workers: int, model_name: str,
                    progress=None, **kwargs) -> list[dict]:
    """`shared_prefill.run_plans` with the samples dealt out to `workers` processes (this one included).

    This process runs the first share with `model`; each other share loads `model_name` in a fresh process. Every
    process uses `cores // workers` threads. `workers=1` runs everything here, with the threads torch already has.
    `progress(done, share)` reports this process's share only.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, got {workers!r}")
    rows = [dict(r) for r in samples]
    workers = min(workers, len(rows)) or 1
    shares = [rows[k::workers] for k in range(workers)]  # dealt, so every share holds every length and depth

    def mine(done: int) -> None:  # progress(samples done, samples in this process's share)
        if progress is not None:
            progress(done, len(shares[0]))

    if workers == 1:
        return order_records(run_plans(model, tokenizer, plans, rows, model_name=model_name, progress=mine,
                                       **kwargs), plans, rows)
    if model.device.type != "cpu":
        raise ValueError(f"workers > 1 split the samples between CPU processes; the model is on {model.device}: "
                         "use workers=1 on a GPU")
    threads = max(1, cpu_cores() // workers)
    before = torch.get_num_threads()
    with ProcessPoolExecutor(workers - 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_share, model_name, list(plans), share, kwargs, threads) for share in shares[1:]]
        torch.set_num_threads(threads)
        try:
            records = run_plans(model, tokenizer, plans, shares[0], model_name=model_name, progress=mine, **kwargs)
        finally:
            torch.set_num_threads(before)
        records += [r for future in futures for r in future.result()]
    return order_records(records, plans, rows)
