"""One layer's C++ kernel call over keys grouped per token: the instruction-set key path against the portable loop.

Question: what does the AVX-512 (or AVX2) key path for keys grouped along head_dim per token (`int4:key_axis=token`,
KVzip's int4 pairs; cpu_decode_avx512.h `token_key_logits`) save per layer call against the portable loop that
dequantises a tile and takes a dot per (row, token), in one process?
Command:
    OMP_NUM_THREADS=1 python benchmarks/probes/token_key_kernel_ab.py [--tokens 4096] [--bits 4] [--group-size 32]
        [--shape smollm2|gemma3] [--layers 30] [--repeats 7]
Written up: docs/speed.md, "Keys grouped per token read by the kernel's vector path".

A store of random states (`IntNCodec(key_axis="token")`, scales in bf16 as the codec stores them) at the model's
shapes (SmolLM2: 3 KV heads, 3 query rows each, head_dim 64; Gemma-3-270M: 1 KV head, 4 rows, head_dim 256), read as
a per-head store is (`spans`: flat pairs, each head its own count, 0.75-1.0 of `--tokens`) by `decode_attention`
with a tail of 32 tokens. `--layers` copies of it are read in turn, so each call meets a store that is not in the
caches, as a decode step's 30 layers are. CPU time of the process; the median over `--repeats` interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.ops import cpu_decode

SHAPES = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256)}  # KV heads, query rows per KV head, head_dim


def _layer(codec: IntNCodec, tokens: int, heads: int, rows: int, dim: int, g: torch.Generator) -> list:
    """decode_attention's arguments for one layer: a flat per-head store read by spans, and a 32-token tail."""
    counts = [int(tokens * (0.75 + 0.25 * h / max(heads - 1, 1))) for h in range(heads)]
    keys = torch.randn(1, 1, sum(counts), dim, generator=g) * 2
    encoded = [codec.encode(x, kind) for x, kind in ((keys, "key"), (keys.flip(-1), "value"))]
    starts = torch.tensor([sum(counts[:h]) for h in range(heads)])
    spans = torch.stack([starts, torch.tensor(counts)], -1)[None]
    query = torch.randn(1, heads, rows, dim, generator=g) * 0.3
    tail = torch.randn(1, heads, 32, dim, generator=g)
    bias = torch.zeros(1, 1, 1, max(counts) + 32)
    return [query[:, :, :, None].contiguous(), query, *encoded, codec.kernel_layout("key"),
            codec.kernel_layout("value"), dim, bias, None, None, None, tail, tail, True, None, None, None, spans]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--bits", type=int, default=4, choices=[2, 4, 8])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads, rows, dim = SHAPES[args.shape]
    codec = IntNCodec(bits=args.bits, group_size=args.group_size, key_axis="token")
    g = torch.Generator().manual_seed(0)
    layers = [_layer(codec, args.tokens, heads, rows, dim, g) for _ in range(args.layers)]
    first = layers[0]
    paths = cpu_decode.vector_paths(first[2], first[3], first[4], first[5], dim, dim)
    print(f"instruction set {cpu_decode.instruction_set()}, vector paths (keys, values): {paths}")

    def one_round(vectorised: bool) -> float:
        start = time.process_time()
        for layer in layers:
            cpu_decode.decode_attention(*layer[:13], vectorised, *layer[14:])
        return (time.process_time() - start) / len(layers) * 1e6

    outputs = [cpu_decode.decode_attention(*first[:13], v, *first[14:]) for v in (True, False)]
    gap = max(float((a - b).abs().max()) for a, b in zip(*outputs, strict=True))
    for vectorised in (True, False):  # warm-up
        one_round(vectorised)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for vectorised in (True, False):
            times[vectorised].append(one_round(vectorised))
    fast, portable = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.shape} int{args.bits} g{args.group_size}, {args.tokens} tokens, {args.layers} layers: "
          f"vector {fast:.0f} us, portable {portable:.0f} us per layer call ({fast / portable:.2f}x); "
          f"largest output gap {gap:.1e}")


if __name__ == "__main__":
    main()
