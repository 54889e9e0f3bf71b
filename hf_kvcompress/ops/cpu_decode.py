"""Decode attention over a packed int2/int4/int8 or float8 store in one C++ kernel on CPU (cpu_decode.cpp).

In eager PyTorch every pass over a block of the store (planes to float32, scales, matmul, folds) costs about as
much as DynamicCache's whole matmul (docs/benchmark-notes.md, section 5); the kernel reads each code byte once and keeps
the dequantised tile in L1. It is compiled on first use with torch's JIT extension builder (-O3 -march=native, so
the build belongs to this CPU: its name carries a digest of the CPU's flags) and cached in torch's extensions
folder under a digest of the source. Without a compiler, `available()` warns once and says False; store
attention then stays in PyTorch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# What SOURCE includes (the AVX-512 and AVX2 paths, low rank's key logits): part of the build's digest and copied next
# to it.
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_decode_avx512.h", "cpu_decode_avx2.h", "cpu_lowrank.h")]
PLAIN, AFFINE, FLOAT8 = 0, 1, 2  # how codes become levels (see cpu_decode.cpp)


@dataclass(frozen=True)
class KernelLayout:
    """How the kernel reads one kind (keys or values) of a store.

    bits: 2, 4 or 8 per code. levels: (L0, a, b) with level(c) = L0 + a*c + b*(c >> 1), the code itself being
    (0, 1, 0). float8: the codes are E4M3 bytes (levels ignored). offset_queries: per-channel key groups were turned
    back by each key's offset in its group (pre_rope), so each offset meets its own query."""

    bits: int
    levels: tuple[float, float, float] = (0.0, 1.0, 0.0)
    float8: bool = False
    offset_queries: bool = False


FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


def _build_name(flags: tuple[str, ...]) -> str:
    """The build's name: a digest of the source, the flags, this CPU's instruction sets (a -march=native build runs
    only where it was built), torch and Python. A changed source or another CPU builds anew under another name, and
    two checkouts of the same source share one build (torch's own versioning keys on the source's path and rebuilt
    whenever processes alternated between two checkouts)."""
    digest = hashlib.sha1(SOURCE.read_bytes())
    for header in HEADERS:
        digest.update(header.read_bytes())
    digest.update(" ".join([*flags, platform.machine(), torch.__version__, sys.version]).encode())
    try:
        with open("/proc/cpuinfo") as info:
            digest.update(next((line for line in info if line.startswith(("flags", "Features"))), "").encode())
    except OSError:
        pass
    return f"hf_kvcompress_cpu_decode_{digest.hexdigest()[:16]}"


def _build_root() -> Path:
    """Where torch keeps JIT-built extensions (TORCH_EXTENSIONS_DIR, else the user's cache folder)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def _load_built(name: str, library: Path):
    """Import an extension already built: importing torch.utils.cpp_extension to ask costs 0.2 s of CPU (setuptools),
    a fifth of a decode step's time at 4k tokens if paid at the first step of a short generation."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the built extension {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _extension(flags: tuple[str, ...] = tuple(FLAGS)):
    """The compiled module, or None (with one warning) when it cannot be built here. Other `flags` build another
    copy (the tests build one with -mno-avx512f, to run the AVX2 paths on an AVX-512 CPU)."""
    try:
        name = _build_name(flags)
        folder = _build_root() / name
        library = folder / f"{name}.so"
        if library.exists():
            return _load_built(name, library)
        from torch.utils.cpp_extension import load  # heavy, and needs the cpu-kernel extra (ninja): only to build

        folder.mkdir(parents=True, exist_ok=True)
        source = folder / SOURCE.name  # compiled from a copy at a path that only this source's digest names
        for original in [*HEADERS, SOURCE]:
            copy = folder / original.name
            if not copy.exists():
                partial = folder / f"{original.name}.{os.getpid()}"
                shutil.copyfile(original, partial)
                os.replace(partial, copy)
        return load(name=name, sources=[str(source)], extra_cflags=list(flags), build_directory=str(folder),
                    verbose=False)
    except Exception as error:  # no compiler, no headers, a failed build: the PyTorch path still answers
        warnings.warn(f"the CPU decode-attention kernel could not be built ({error}); attention over the encoded "
                      "store runs in PyTorch (slower). The build needs a C++ compiler and ninja: "
                      'pip install "hf-kvcompress[cpu-kernel]"', RuntimeWarning, stacklevel=2)
        return None


def available() -> bool:
    """Whether the kernel is built (building it on the first call: about a minute, then cached across processes)."""
    return _extension() is not None


def _built():
    """The built extension; a RuntimeError where it could not be built (callers check `available()` first)."""
    extension = _extension()
    if extension is None:
        raise RuntimeError("the CPU decode-attention kernel is not available on this machine (see the warning)")
    return extension


def instruction_set() -> str:
    """The instruction-set paths compiled into the kernel: "avx512" (cpu_decode_avx512.h) or "portable"."""
    extension = _extension()
    return "portable" if extension is None else extension.instruction_set()


def row_stride(tensor: torch.Tensor) -> int:
    """The elements between rows (b, h) of `tensor` [B, H, n, w], as `in_rows` reads it (n x w for a single row)."""
    batch, heads, n, width = tensor.shape
    return tensor.stride(1) if heads > 1 else tensor.stride(0) if batch > 1 else n * width


def in_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` [B, H, n, w] as the kernel reads a store's codes and scales: rows (b, h) of contiguous n x w elements,
    evenly spaced (cpu_decode.cpp `row_stride`; the Triton kernel reads the same). A view of the first n slots of a
    room with spare ones (caches/encoded_room.py) is read in place, not copied: the copy would cost a decode step
    what the room saves."""
    batch, heads, n, width = tensor.shape
    stride = row_stride(tensor)
    packed = (width <= 1 or tensor.stride(3) == 1) and (n <= 1 or tensor.stride(2) == width)
    if (packed and width > 0 and stride >= n * width and stride % width == 0
            and (batch <= 1 or heads <= 1 or tensor.stride(0) == heads * stride)):
        return tensor
    return tensor.contiguous()


def packed_rows(encoded: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A {codes, scale, zero} store's tensors as the kernels (this one and ops/triton_decode.py) read them: each
    `in_rows`, the scales and zero points at one row stride (copied where they differ)."""
    scale, zero = in_rows(encoded["scale"]), in_rows(encoded["zero"])
    if scale.stride() != zero.stride():  # the kernels read both at one row stride
        scale, zero = scale.contiguous(), zero.contiguous()
    return in_rows(encoded["codes"]), scale, zero


def _arguments(encoded: dict, layout: KernelLayout) -> list:
    if layout.float8:
        codes = encoded["values"].view(torch.uint8)
        return [in_rows(codes), in_rows(encoded["scale"]), None, FLOAT8, 0.0, 1.0, 0.0]
    mode = PLAIN if layout.levels == (0.0, 1.0, 0.0) else AFFINE
    return [*packed_rows(encoded), mode, *layout.levels]


def vector_paths(
    encoded_keys: dict, encoded_values: dict, key_layout: KernelLayout, value_layout: KernelLayout, dim: int,
    value_dim: int, offsets: int = 1,
) -> tuple[bool, bool]:
    """Which parts of a call over this store the instruction-set paths (`instruction_set()`) read: (keys, values),
    for keys of head_dim `dim` met by `offsets` queries per row (1, or one per offset of a per-channel key group).
    What they do not read takes the portable loops; where the build has no such paths, (False, False)."""
    keys, values = _arguments(encoded_keys, key_layout)[:4], _arguments(encoded_values, value_layout)[:4]
    reads = _built().vector_paths(*keys, *values, dim, value_dim, offsets)
    return bool(reads[0]), bool(reads[1])


def decode_attention_partials(
    query: torch.Tensor, encoded_keys: dict, encoded_values: dict, key_layout: KernelLayout,
    value_layout: KernelLayout, value_dim: int, bias: torch.Tensor | None, hidden: torch.Tensor | None,
    vectorised: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax partials of `query` [B, H_kv, M, O, D] (scaled, in the store's basis; O = 1, or one query per
    offset of a per-channel key group when `key_layout.offset_queries`) over the store's T tokens.

    `bias` [B or 1, H_kv or 1, Q, T] float32 is added to the logits (row m of M takes bias row m % Q); `hidden`
    [B, H_kv, S] int64 lists slots to leave out (-1: none). Returns the max and sum [B, H_kv, M, 1] and the
    unnormalised output [B, H_kv, M, Dv], as triton_decode.decode_attention_partials. `vectorised=False` keeps
    to the portable loops (the reference for the instruction-set paths, `instruction_set()`)."""
    extension = _built()
    return tuple(extension.decode_attention_partials(
        query.float().contiguous(), *_arguments(encoded_keys, key_layout), *_arguments(encoded_values, value_layout),
        value_dim, bias, None if hidden is None else hidden.long().contiguous(), vectorised,
    ))


# The dtypes the kernel reads the exact sinks and the tail in; any other is read as float32.
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_attention(
    query: torch.Tensor, plain_query: torch.Tensor, encoded_keys: dict, encoded_values: dict, key_layout: KernelLayout,
    value_layout: KernelLayout, value_dim: int, bias: torch.Tensor | None, sink_slots: torch.Tensor | None,
    sink_keys: torch.Tensor | None, sink_values: torch.Tensor | None, tail_keys: torch.Tensor,
    tail_values: torch.Tensor, vectorised: bool = True, key_rotation: torch.Tensor | None = None,
    value_rotation: torch.Tensor | None = None, key_turns: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's whole decode attention in one call: the store (as `decode_attention_partials` reads it), its exact
    sinks [B, H_kv, S, D] at `sink_slots` [B, H_kv, S] (a slot outside the store weighs nothing there: no sink, or one
    still in the tail) and its tail [B, H_kv, Tt, D], in one softmax. `plain_query` [B, H_kv, M, D] (scaled, the
    model's basis) meets sinks and tail; `bias` [B or 1, H_kv or 1, Q, T + Tt] float32 covers the store's and the
    tail's columns (a sink reads its slot's). Returns the store's part [B, H_kv, M, Dv] in the values' storage basis and
    the plain part [B, H_kv, M, Dv], both divided by the whole softmax sum (a fully masked row gives zeros): the
    output is the first brought back from its basis plus the second. Each step pays one call instead of the few dozen
    small tensor ops that merging the segments in PyTorch costs (docs/speed.md).

    `key_rotation` [D, D] float32: `query` [B, H_kv, M, 1, D] is in the model's basis and the kernel meets the keys
    with query @ key_rotation. `value_rotation` [Dv, Dv] float32 (orthogonal): the values were stored as
    x @ value_rotation, and the store's part is returned in the model's basis (times its transpose). `key_turns`
    [2, O, R] float32 (cos, sin; `rerotate.rope_table` of each offset o < O over the first R channels): `query`
    [B, H_kv, M, 1, D] (the model's basis) is turned by each offset (`rerotate.turn`) into the O offset queries of
    per-channel key groups, then rotated by `key_rotation` if given (pre_rope keys). All are a row's own products
    summed in a fixed order, so a batch row gives what it gives alone.

    `spans` [B, H_kv, 2] int64 (first token, tokens): the store is flat, its encoded tensors [1, 1, N, ...], and
    row (b, h) holds tokens [first, first + tokens) of it (a per-head store, each head with its own number of pairs:
    caches/head_store.py), read as the last `tokens` of T logical slots, T the most any row holds: the bias's store
    columns are those T, and a row reads none of the slots before its first (no padded view is built, no empty slot
    read). Token groups of one only (`kernel_layout` of a codec that encodes each token alone)."""
    extension = _built()
    plain_dtype = tail_keys.dtype if tail_keys.dtype in PLAIN_DTYPES else torch.float32
    plain = [None if t is None else t.to(plain_dtype).contiguous() for t in (sink_keys, sink_values)]
    if sink_slots is None:
        plain = [None, None]
    return tuple(extension.decode_attention(
        query.float().contiguous(), plain_query.float().contiguous(), *_arguments(encoded_keys, key_layout),
        *_arguments(encoded_values, value_layout), value_dim, bias,
        None if sink_slots is None else sink_slots.long().contiguous(), *plain,
        tail_keys.to(plain_dtype).contiguous(), tail_values.to(plain_dtype).contiguous(), vectorised,
        None if key_rotation is None else key_rotation.float().contiguous(),
        None if value_rotation is None else value_rotation.float().contiguous(),
        None if key_turns is None else key_turns.float().contiguous(),
        None if spans is None else spans.long().contiguous(),
    ))


@dataclass(frozen=True)
class AffineCodes:
    """How a kernel reads a kind's stored numbers where they lie: 4-bit codes c (two a byte, the even channel in the
    low half) that stand for y = c * scale + zero (bf16 scale and zero point, float32 arithmetic), one scale and zero
    per group of `group_size` tokens per channel (`per_channel`, KIVI keys) or of `group_size` channels per token; and
    where `signs` [w] float32 is given, the stored numbers were rotated (ops/hadamard.py's `rotate` with these signs)
    and the number meant is `unrotate(y)`. What codecs/intn.py's `plain_codes` describes."""

    group_size: int
    per_channel: bool
    signs: torch.Tensor | None = None


def _codes_arguments(encoded: dict | None, layout: AffineCodes | None) -> list:
    """A kind's codes as the low-rank kernel takes them: codes [B, T, w / 2], scale, zero, group, per_channel, signs
    (Nones without codes)."""
    if encoded is None or layout is None:
        return [None, None, None, 1, False, None]
    codes, scale, zero = (encoded[name][:, 0] for name in ("codes", "scale", "zero"))
    if scale.stride() != zero.stride():  # the kernel reads both at one set of strides
        scale, zero = scale.contiguous(), zero.contiguous()
    signs = None if layout.signs is None else layout.signs.float().contiguous()
    return [codes, scale, zero, layout.group_size, layout.per_channel, signs]


def lowrank_decode_attention(
    latent: torch.Tensor, basis: torch.Tensor, pairs: torch.Tensor | None, round_bf16: bool, mean: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, query: torch.Tensor, value_latent: torch.Tensor, value_basis: torch.Tensor,
    value_mean: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor | None, sink_keys: torch.Tensor | None,
    sink_values: torch.Tensor | None, tail_keys: torch.Tensor, tail_values: torch.Tensor, vectorised: bool = True,
    codes: tuple[dict, dict, AffineCodes, AffineCodes] | None = None,
) -> torch.Tensor:
    """A decode step's attention of `query` [B, H, M, D] (float32, scaled, the model's basis) over a layer that holds a
    joint low-rank store, its exact sinks and its full-precision tail, in one call (cpu_lowrank.h). The store's keys
    query . RoPE(p_t)(basis_h z_t + mean_h) are rebuilt, turned and met a tile of tokens at a time without leaving
    registers, masked, and folded into an online softmax that mixes the value latents: `latent` [B, T, r] (float32,
    bfloat16 or float16, unit stride over r), the key latents; `basis` [H, r, D] float32 (the key basis transposed);
    `mean` [H, D]; `cos`, `sin` [B, R / 2, T] float32 (RoPE's turn at each token's position over the first R channels,
    rotate-half; unit stride over T). `round_bf16`: bf16 products (the latents rounded to bf16, `basis` holding bf16
    values); `pairs` [H, ceil(r / 2), D] int32, the bf16 basis as pairs of rank entries (`bf16_pairs`), read where the
    build multiplies bf16 pairs natively (AVX512-BF16), or None. `value_latent` [B, T, rv] (unit stride over rv).
    Then the sinks `sink_keys` /
    `sink_values` [B, H, S, D] at the store slots `hidden` [B, H, S] names (a slot outside the store: none, or one still
    in the tail) and the tail `tail_keys` / `tail_values` [B, H, Tt, D] after the store, in the tail's dtype, in the
    same softmax; the store's value-latent mix is mapped to values by `value_basis` [H, Dv, rv] and `value_mean`
    [H, Dv] (float32). `bias` [B or 1, H or 1, Q, T + Tt] float32 covers the store's and the tail's columns (a sink
    reads its slot's). Returns [B, H, M, Dv] float32, normalised (a row with every logit masked: zeros): what
    caches/store_attention.py's segments make of the store's partials, the sums in another order. `hidden` and the sink
    states are None where the layer holds no sinks. `vectorised=False` keeps to the portable loops (the reference for
    the instruction-set paths).

    `codes`: (key store, value store, key layout, value layout), the store's first Tq tokens as 4-bit codes read where
    they lie ({codes, scale, zero} [B, 1, ...] of codecs/intn.py, `AffineCodes`): each tile's latents are decoded in
    the kernel to what the codec's `decode` gives for them (bit for bit, `unrotate`'s additions included); `latent`
    and `value_latent` then hold the Tq + 1st token on (a stack's held residual; may be empty), and `cos`, `sin` and
    `bias` cover all T = Tq + those tokens."""
    extension = _built()
    exact = [None if t is None else t.contiguous() for t in (sink_keys, sink_values)]
    keys, values = (None, None) if codes is None else codes[:2]
    key_layout, value_layout = (None, None) if codes is None else codes[2:]
    return extension.lowrank_decode_attention(
        latent, basis, pairs, round_bf16, mean, cos, sin, query, value_latent, value_basis, value_mean,
        None if bias is None else bias.float(), None if hidden is None else hidden.long().contiguous(),
        *exact, tail_keys.contiguous(), tail_values.contiguous(), vectorised,
        *_codes_arguments(keys, key_layout), *_codes_arguments(values, value_layout),
    )


def lowrank_encode(states: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, mean: torch.Tensor,
                   encoder: torch.Tensor) -> torch.Tensor:
    """A few tokens' latents for a joint low-rank store in one call (cpu_lowrank.h `turn_in_place`, `project`):
    `states` [B, H, n, D] (float32, bfloat16 or float16) turned by rotate-half RoPE where `cos` and `sin`
    [B, H, n, R / 2] (float32; the turn to apply) are given, `mean` [H, D] subtracted and the heads' [H * D] projected
    on `encoder` [H, D, r] (float32): [B, 1, n, r] float32, what codecs/lowrank.py's `rerotate` and `reduce` make
    of them, the projection's sums in another order."""
    extension = _built()
    table = [None if t is None else t.float().contiguous() for t in (cos, sin)]
    return extension.lowrank_encode(states, *table, mean.float().contiguous(), encoder.float().contiguous())


def bf16_pairs(basis: torch.Tensor) -> torch.Tensor:
    """`basis` [H, D, r] as the bf16 pairs `lowrank_decode_attention` reads: [H, ceil(r / 2), D] int32, each word
    holding rank entries 2j (low half) and 2j + 1 (high half; 0 past r) of a channel, rounded to bf16."""
    heads, dim, rank = basis.shape
    padded = torch.zeros(heads, dim, rank + rank % 2, dtype=torch.bfloat16, device=basis.device)
    padded[..., :rank] = basis
    # Little-endian: element 2j of a pair is the word's low half.
    return padded.view(torch.int32).transpose(1, 2).contiguous()
