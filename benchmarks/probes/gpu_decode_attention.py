"""GPU: decode attention over int4/int2 stores (Triton kernel) against bf16 SDPA over a full cache.

Question: on a GPU, how fast is one decode query over int4 and int2 stores (Triton kernel, and the PyTorch block
path) against bf16 SDPA over the full cache, as a share of the HBM bandwidth, and how far is its output from SDPA's?
Command:
    python benchmarks/probes/gpu_decode_attention.py [--lengths 8192,32768,131072] [--batches 1,8] [--repeats 50]
Written up: docs/speed.md, "On a GPU: the first measurements (session 26)" (one H200: the Triton path is
host-bound, 1.2-1.7 ms per layer at batch 1 against SDPA's 40-90 us); docs/benchmark-notes.md section 4.

Shapes: one attention layer of a ~1B-parameter Llama (Llama-3.2-1B: 32 query heads on 8 KV heads of 64 dims,
bf16), built from a config with random weights; a real model's weights do not change the cost of attention. For
each length and batch it fills one cache layer per codec with random post-RoPE states, then times one decode query:
- `sdpa bf16`: torch SDPA over the full bf16 cache (what DynamicCache + SDPA do);
- `<codec> triton`: caches/store_attention.attend_store with the Triton kernel reading the packed store;
- `<codec> torch`: the same in PyTorch, a block at a time (the reference path).
Achieved bandwidth = bytes the path must read (the cache as stored, scales included) / median time; the error
column is the largest difference from SDPA over the same layer's decoded cache (tf32 dots in the kernel).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from hf_kvcompress import make_cache
from hf_kvcompress.caches.store_attention import attend_store
from hf_kvcompress.measure import measured_kv_bytes

HBM_BYTES_PER_S = 4.3e12  # H200
Q_HEADS, KV_HEADS, DIM = 32, 8, 64
# int2's plain name stores pre-RoPE keys on Gaussian levels, which the kernel leaves to PyTorch (store_attention's
# `store_kernel`); the kernel's 2-bit form is the uniform grid on post-RoPE keys.
CODECS = ["int4", "int2:codebook=uniform,pre_rope=false"]


def _time(fn, repeats: int) -> float:
    """Median seconds per call, CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _filled_layer(spec: str, batch: int, tokens: int, generator: torch.Generator):
    """One cache layer holding `tokens` random states, filled a chunk at a time (as a prefill would)."""
    cache = make_cache(spec)
    chunk = 8192
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        keys = torch.randn(batch, KV_HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        values = torch.randn(batch, KV_HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        positions = torch.arange(start, start + n, device="cuda")[None].expand(batch, n)
        cache.update(keys, values, 0, {"position_ids": positions})
    return cache


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe needs a CUDA GPU (benchmarks/probes/decode_step.py is the CPU equivalent)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    scale = DIM ** -0.5
    print(f"{torch.cuda.get_device_name()}: one decode query, {Q_HEADS} query heads on {KV_HEADS} KV heads x {DIM}")
    print(f"{'tokens':>7s} {'batch':>5s} {'path':16s} {'us':>9s} {'MB read':>9s} {'GB/s':>8s} {'of peak':>7s} "
          f"{'max err':>9s}")
    for tokens in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            query = torch.randn(batch, Q_HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
            dynamic = _filled_layer("dynamic", batch, tokens, generator)
            layer = dynamic.layers[0]
            keys, values = layer._full("key"), layer._full("value")

            def sdpa(q=query, k=keys, v=values):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            rows = [("sdpa bf16", _time(sdpa, args.repeats), measured_kv_bytes(dynamic), 0.0)]
            del dynamic, keys, values, layer
            for codec in CODECS:
                cache = _filled_layer(codec, batch, tokens, generator)
                layer = cache.layers[0]
                reference = torch.nn.functional.scaled_dot_product_attention(
                    query.float(), layer._full("key").float(), layer._full("value").float(), scale=scale,
                    enable_gqa=True,
                ).transpose(1, 2)
                for backend in ("triton", "torch"):
                    out = attend_store(layer, query, None, scale, backend=backend)
                    error = (out.float() - reference).abs().max().item()
                    seconds = _time(partial(attend_store, layer, query, None, scale, backend=backend), args.repeats)
                    rows.append((f"{codec.split(':')[0]} {backend}", seconds, measured_kv_bytes(cache), error))
                del cache, layer
                torch.cuda.empty_cache()
            for name, seconds, nbytes, error in rows:
                rate = nbytes / seconds
                print(f"{tokens:7d} {batch:5d} {name:16s} {seconds * 1e6:9.1f} {nbytes / 1e6:9.1f} {rate / 1e9:8.0f} "
                      f"{rate / HBM_BYTES_PER_S:7.1%} {error:9.2e}", flush=True)


if __name__ == "__main__":
    main()
