"""One layer's C++ kernel call over an fp8 (E4M3) store: the instruction-set paths against the portable loops.

Question: what do the AVX-512 (or AVX2) key and value paths for E4M3 codes (cpu_decode_avx512.h `e4m3_word_levels`,
`e4m3_levels`: bytes to float16 bits, VCVTPH2PS) save per layer call against the portable loops that decode a tile
byte by byte into a buffer (`e4m3_value`) and take a dot per (row, token), in one process?
Command:
    OMP_NUM_THREADS=1 python benchmarks/probes/fp8_kernel_ab.py [--tokens 4096] [--layers 30] [--repeats 7]
Written up: docs/speed.md, "fp8 read by the kernel's vector paths".

A store of random states encoded by `Fp8Codec` (one float16 scale per token and KV head) at SmolLM2's shapes (3 KV
heads, 3 query rows each, head_dim 64), [1, 3, T, 64] as the cache holds it, read by `decode_attention` with an
empty tail (fp8 encodes each step's tokens on arrival). `--layers` copies are read in turn, so each call meets a
store that is not in the caches, as a decode step's 30 layers are. CPU time of the process; the median over
`--repeats` interleaved rounds. The portable loops are the path every fp8 call took before these vector paths.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress.codecs.fp8 import Fp8Codec
from hf_kvcompress.ops import cpu_decode

HEADS, ROWS, DIM = 3, 3, 64  # SmolLM2: KV heads, query rows per KV head, head_dim


def _layer(codec: Fp8Codec, tokens: int, g: torch.Generator) -> list:
    """decode_attention's arguments for one layer (`vectorised` at index 13)."""
    keys = torch.randn(1, HEADS, tokens, DIM, generator=g) * 2
    values = torch.randn(1, HEADS, tokens, DIM, generator=g)
    encoded = [codec.encode(keys, "key"), codec.encode(values, "value")]
    query = torch.randn(1, HEADS, ROWS, DIM, generator=g) * 0.3
    tail = torch.zeros(1, HEADS, 0, DIM)
    bias = torch.zeros(1, 1, 1, tokens)
    return [query[:, :, :, None].contiguous(), query, *encoded, codec.kernel_layout("key"),
            codec.kernel_layout("value"), DIM, bias, None, None, None, tail, tail, True]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    codec = Fp8Codec()
    g = torch.Generator().manual_seed(0)
    layers = [_layer(codec, args.tokens, g) for _ in range(args.layers)]
    first = layers[0]
    paths = cpu_decode.vector_paths(first[2], first[3], first[4], first[5], DIM, DIM)
    print(f"instruction set {cpu_decode.instruction_set()}, vector paths (keys, values): {paths}")

    def one_round(vectorised: bool) -> float:
        start = time.process_time()
        for layer in layers:
            cpu_decode.decode_attention(*layer[:13], vectorised)
        return (time.process_time() - start) / len(layers) * 1e6

    outputs = [cpu_decode.decode_attention(*first[:13], v) for v in (True, False)]
    gap = max(float((a - b).abs().max()) for a, b in zip(*outputs, strict=True))
    for vectorised in (True, False):  # warm-up
        one_round(vectorised)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for vectorised in (True, False):
            times[vectorised].append(one_round(vectorised))
    fast, portable = statistics.median(times[True]), statistics.median(times[False])
    print(f"fp8, {args.tokens} tokens, {args.layers} layers: vector {fast:.0f} us, portable {portable:.0f} us per "
          f"layer call ({fast / portable:.2f}x); largest output gap {gap:.1e}")


if __name__ == "__main__":
    main()
