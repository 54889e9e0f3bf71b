"""What transformers' SDPA path costs a decode step on CPU: `enable_gqa` (no mask) against packed query heads (a mask).

Question: at 4k tokens in bf16 our caches decode at 0.3-0.5x DynamicCache but at 0.8-1.0x in fp32. transformers 5.24
runs a single-token decode step with no attention mask (batch 1, no padding: DynamicCache's case) as
`scaled_dot_product_attention(..., enable_gqa=True)`, and with a mask (a padded batch, or a cache that hands attention
its own mask, as KVzip's head stores did before session 19) as one SDPA over the query heads packed per KV head
(`pack_gqa`). Does that choice alone, not the cache, explain the dtype gap?
Command:
    python benchmarks/probes/sdpa_gqa_decode.py [--lengths 1024,4096] [--repeats 50]
Written up: docs/speed.md, "Why bf16's ratios look better than fp32's on CPU (session 19)".

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head_dim 64), one query token, random states, one
torch thread; per call process CPU time (mean of `--repeats` after three warm-up calls) of: `enable_gqa=True` (what
transformers runs without a mask), the packed form (what it runs with a mask), and `repeat_interleave` of the keys
(transformers' fallback), with the largest difference between the first two.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, DIM = 9, 3, 64


def per_call_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="cached tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=50, help="calls timed per form")
    args = parser.parse_args()
    torch.set_num_threads(1)
    groups = Q_HEADS // KV_HEADS
    print("| tokens | dtype | enable_gqa ms | packed ms | repeat_kv ms | enable_gqa / packed | max difference |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tokens in (int(x) for x in args.lengths.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, Q_HEADS, 1, DIM, generator=g).to(dtype)
            k = torch.randn(1, KV_HEADS, tokens, DIM, generator=g).to(dtype)
            v = torch.randn(1, KV_HEADS, tokens, DIM, generator=g).to(dtype)

            def gqa(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            def packed(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q.reshape(1, KV_HEADS, groups, DIM), k, v).reshape(q.shape)

            def repeated(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))

            a, b, c = (per_call_ms(fn, args.repeats) for fn in (gqa, packed, repeated))
            diff = (gqa().float() - packed().float()).abs().max().item()
            print(f"| {tokens} | {str(dtype).removeprefix('torch.')} | {a:.3f} | {b:.3f} | {c:.3f} | {a / b:.1f}x "
                  f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
