"""Whether a device multiplies bfloat16 matrices natively, much faster than float32 ones.

A CPU with bf16 dot-product instructions (AVX512-BF16, AMX) runs oneDNN's bf16 GEMM at several times float32's rate
(docs/speed.md, "Low rank's float32 decode"); one without them widens bf16 to float32 in software and is slower
than float32. torch has no public query for the instructions. Where the operating system lists the CPU's flags
(Linux's /proc/cpuinfo on x86) the answer is read from them: the same on every run of one machine, so a cache that
stores by it (lowrank's `compute=auto`) holds the same bytes and answers the same each time. Elsewhere the first
question per process and device kind times the two products once and keeps the answer (a timing near the
threshold may answer differently in another process). `HF_KVCOMPRESS_BF16_MATMUL` ("1" / "0") answers instead of
either. GPUs answer False: their float32 products are fast enough for the callers here (a decode step's key
rebuild), so these never round there unasked.
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
# x86 flags of native bf16 products (/proc/cpuinfo's names); a CPU listing its flags without any of them has none.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"


def fast_bfloat16_matmul(device: torch.device) -> bool:
    """True when `device` multiplies bf16 matrices natively (a CPU: its flags where they can be read, else bf16's
    product timed at most FAST_SHARE of float32's, once per process; False for other devices);
    `HF_KVCOMPRESS_BF16_MATMUL` "1" or "0" forces the answer."""
    forced = os.environ.get(ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{ENV} must be '0' or '1' (or unset: the CPU's flags, else measured), got {forced!r}")
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


def _x86_flags(path: str = CPUINFO) -> set[str] | None:
    """The first x86 CPU's flags as the OS lists them (Linux: the "flags" line of /proc/cpuinfo); None where there is
    no such list (another OS or architecture: ARM lists "Features")."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                name, sep, value = line.partition(":")
                if sep and name.strip() == "flags":
                    return set(value.split())
    except OSError:
        return None
    return None


@functools.cache
def _cpu_is_fast() -> bool:
    """The CPU's answer, kept for the process: from its flags where the OS lists them and torch has oneDNN (whose
    GEMM uses the instructions), else timed."""
    flags = _x86_flags()
    if flags is not None and torch.backends.mkldnn.is_available():
        return any(flag in flags for flag in BF16_FLAGS)
    return _measured_fast()


def _measured_fast() -> bool:
    """bf16's product at most FAST_SHARE of float32's, timed (where the CPU's flags cannot be read)."""
    rows, inner, cols = _SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=g), torch.randn(inner, cols, generator=g)
    with torch.inference_mode():
        single = _best_time(a, b)
        half = _best_time(a.bfloat16(), b.bfloat16())
    return half <= FAST_SHARE * single
