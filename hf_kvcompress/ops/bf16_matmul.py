"""Whether a device multiplies bfloat16 matrices natively, much faster than float32 ones.

A CPU with bf16 dot-product instructions (AVX512-BF16, AMX) runs oneDNN's bf16 GEMM at several times float32's rate
(docs/speed.md, "Low rank's float32 decode"); one without them widens bf16 to float32 in software and is slower
than float32. torch has no public query for the instructions, so the first
question per process and device kind times the two products once and keeps the answer. `HF_KVCOMPRESS_BF16_MATMUL`
("1" / "0") answers instead of the measurement. GPUs answer False: their float32 products are fast enough for the
callers here (a decode step's key rebuild), so these never round there unasked.
"""

from __future__ import annotations

import functools
import os
import time

import torch

ENV = "HF_KVCOMPRESS_BF16_MATMUL"
# bf16 must take at most this share of float32's time: rounding the operands buys nothing below a clear gain.
FAST_SHARE = 0.6
# The timed product: the shape of a decode step's key rebuild (H * D rows, a rank of inner products, tokens), small
# enough to cost a few ms once per process.
_SHAPE = (192, 64, 1024)
_REPEATS = 5


def fast_bfloat16_matmul(device: torch.device) -> bool:
    """True when `device` multiplies bf16 matrices natively and at most FAST_SHARE of float32's time (measured once
    per process for CPUs; False for other devices); `HF_KVCOMPRESS_BF16_MATMUL` "1" or "0" forces the answer."""
    forced = os.environ.get(ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{ENV} must be '0' or '1' (or unset: measured), got {forced!r}")
        return forced == "1"
    if device.type != "cpu":
        return False
    return _cpu_is_fast()


def _best_time(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fastest of _REPEATS products after one untimed (the least disturbed by other processes on the cores)."""
    torch.mm(a, b)
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def _cpu_is_fast() -> bool:
    rows, inner, cols = _SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=g), torch.randn(inner, cols, generator=g)
    with torch.inference_mode():
        single = _best_time(a, b)
        half = _best_time(a.bfloat16(), b.bfloat16())
    return half <= FAST_SHARE * single
