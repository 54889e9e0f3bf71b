"""Decode attention that reads a layer's encoded store a block at a time, with an online softmax.

Decoding the whole store and concatenating it with the tail at every step touches every stored byte several times
in float32 and, for rotated codecs, applies the inverse rotation to every stored token. Here each block of
`STORE_BLOCK` tokens is read in the codec's storage basis only (the query is rotated once instead, and the
output once at the end) through the codec's `key_logits` and `mix_values` (which may skip decoding the codes,
codecs/plane_attention.py), its logits folded into a running max and sum (flash-decoding, Dao et al. 2023), and
dropped: the transient memory is one block, not the whole cache in float32. The exact attention sinks and the
full-precision tail are two more segments of the same softmax. `CompressedLayer._full` + SDPA is the reference.
A kernel may read the layer instead, store, sinks and tail in one call per step: Triton on CUDA returns the softmax's
partials in both bases (ops/triton_decode.py), the C++ kernel on CPU (ops/cpu_decode.py) the normalised output
(`attend_by_cpu_kernel`, which a per-head store calls too, with its pairs where they lie: head_store.py).
A codec may also read the whole layer in a kernel of its own (`layer_kernel`, `attend_layer`: lowrank's keys rebuilt
from latents on CPU, ops/cpu_lowrank.h, its sinks and tail met in the same call), which returns the normalised output.
The PyTorch loop stays the reference (`backend="torch"`).
"""

from __future__ import annotations

from typing import overload

import torch

from ..codecs.base import Codec, Encoded, slice_encoded
from ..ops import cpu_decode, triton_decode

# Tokens read at a time: at most STORE_BLOCK, and at most STORE_BLOCK_VALUES values (batch x KV heads x tokens x
# head_dim, 4 MiB of float32) so the transient memory stays bounded; rounded up to whole codec token blocks. Each
# block costs a few dozen small tensor ops, which at 1024 tokens were a third of the store's time on CPU.
STORE_BLOCK = 8192
STORE_BLOCK_VALUES = 1 << 20
# Query rows per KV head up to which the C++ kernel rotates (and for pre_rope turns) the query itself: a decode step's
# few rows. A prefill chunk's hundreds (times pre_rope's 32 offsets) go through BLAS, which multiplies many rows
# faster than the kernel's plain loop over each.
KERNEL_ROTATION_ROWS = 64
BACKENDS = ("auto", "torch", "triton", "cpu")


class _OnlineSoftmax:
    """Running max, sum and two outputs (storage basis and plain) over segments of keys, for [B, H_kv, n, *]."""

    def __init__(self):
        self.max = self.total = self.stored = self.plain = None

    def add(self, logits: torch.Tensor, values, stored_basis: bool) -> None:
        """logits [B, H_kv, n, k] (masked entries -inf); values [B, H_kv, k, Dv] in float32, or a function of the
        probabilities [B, H_kv, n, k] that returns their product with the values (a codec's `mix_values`)."""
        block_max = logits.amax(-1, keepdim=True)
        safe = self._rescale(block_max)
        probs = torch.exp(logits - safe)
        mixed = values(probs) if callable(values) else torch.matmul(probs, values)
        self._accumulate(probs.sum(-1, keepdim=True), mixed, stored_basis)

    def _rescale(self, block_max: torch.Tensor) -> torch.Tensor:
        """Raise the running max to cover `block_max`, rescaling what is accumulated; returns the max to subtract."""
        new_max = block_max if self.max is None else torch.maximum(self.max, block_max)
        safe = new_max.masked_fill(new_max == float("-inf"), 0.0)  # a row masked so far: exp(-inf - 0) = 0
        if self.max is not None:
            rescale = torch.exp(self.max - safe)
            self.total = self.total * rescale
            self.stored = None if self.stored is None else self.stored * rescale
            self.plain = None if self.plain is None else self.plain * rescale
        self.max = new_max
        return safe

    def _accumulate(self, total: torch.Tensor, part: torch.Tensor, stored_basis: bool) -> None:
        self.total = total if self.total is None else self.total + total
        if stored_basis:
            self.stored = part if self.stored is None else self.stored + part
        else:
            self.plain = part if self.plain is None else self.plain + part


@overload
def _bias(mask: torch.Tensor, groups: int, columns: slice | torch.Tensor) -> torch.Tensor: ...
@overload
def _bias(mask: None, groups: int, columns: slice | torch.Tensor) -> None: ...
@overload
def _bias(mask: torch.Tensor | None, groups: int, columns: slice | torch.Tensor) -> torch.Tensor | None: ...
def _bias(mask: torch.Tensor | None, groups: int, columns: slice | torch.Tensor) -> torch.Tensor | None:
    """The attention mask's `columns` as an additive float32 bias [B, 1 or H_kv, groups * q, k]."""
    if mask is None:
        return None
    if isinstance(columns, slice):
        part = mask[..., columns]
    else:  # per-head columns [B, H_kv, S] (the sinks' slots)
        b, h, s = columns.shape
        part = mask.expand(b, h, *mask.shape[2:]).gather(3, columns[:, :, None, :].expand(b, h, mask.shape[2], s))
    if part.dtype == torch.bool:
        part = torch.zeros(part.shape, dtype=torch.float32, device=part.device).masked_fill_(~part, float("-inf"))
    else:
        part = part.float()
    b, h, q, k = part.shape
    return part[:, :, None].expand(b, h, groups, q, k).reshape(b, h, groups * q, k)


def _sink_hidden(layer, start: int, end: int) -> torch.Tensor:
    """[B, H_kv, end - start] bool: the slots of [start, end) that hold a sink (attended exactly elsewhere)."""
    sink_slots = layer.slots.sink_slots
    inside = (sink_slots >= start) & (sink_slots < end)
    hidden = torch.zeros(*sink_slots.shape[:2], end - start + 1, dtype=torch.bool, device=sink_slots.device)
    hidden.scatter_(2, torch.where(inside, sink_slots - start, end - start), True)
    return hidden[:, :, : end - start]


def _store_by_blocks(layer, stored_q, attention_mask, groups: int, softmax: _OnlineSoftmax) -> None:
    """The store segment, `STORE_BLOCK` tokens at a time, in PyTorch (the reference for the kernels): the encoded
    slots, then those a stack holds reduced (`held_keys`, read by its `residual_codec` in the same basis)."""
    store = layer.store
    n_enc, n_held = store.n_encoded, store.n_held
    parts = [(layer.codec, store.encoded_keys, store.encoded_values, 0, n_enc)]
    if n_held:
        parts.append((store.residual_codec, store.held_keys, store.held_values, n_enc, n_held))
    batch, heads, _, dim = stored_q.shape
    tokens = min(STORE_BLOCK, max(1, STORE_BLOCK_VALUES // (batch * heads * dim)))
    for codec, encoded_keys, encoded_values, offset, n in parts:
        unit = max(codec.token_block("key"), codec.token_block("value"))
        block = -(-tokens // unit) * unit
        for first in range(0, n, block):
            last = min(first + block, n)
            start, end = offset + first, offset + last
            # A codec that stores keys with their positions (lowrank's pre-RoPE latents) turns them at those
            # positions, and learns which block is the layer's last (lowrank shares a step's turn tables over its
            # layers).
            at = {"positions": layer.slots.positions[:, :, start:end], "last_block": end == n_enc + n_held} \
                if codec.needs_positions else {}
            keys = slice_encoded(encoded_keys, first, last, n)
            values = slice_encoded(encoded_values, first, last, n)
            sinks = layer.slots.sink_slots
            logits = codec.key_logits(keys, stored_q, **at)
            bias = _bias(attention_mask, groups, slice(start, end))
            if bias is not None:
                logits = logits + bias
            if sinks is not None:  # sinks are attended exactly below, not in their decoded form
                logits = logits.masked_fill(_sink_hidden(layer, start, end)[:, :, None], float("-inf"))
            softmax.add(logits, lambda probs, codec=codec, values=values: codec.mix_values(values, probs),
                        stored_basis=True)


def _attend_by_triton(layer, plain_q, stored_q, attention_mask) -> torch.Tensor:
    """Store, exact sinks and tail through the Triton kernel in one launch (one query per row: the mask row is
    shared by the groups): [B, H_kv, groups, Dv], normalised. On a GPU each PyTorch op around a kernel costs a
    launch on the host, which at batch 1 costs more than the kernel's read (docs/speed.md, "On a GPU")."""
    store = layer.store
    tail_keys, tail_values = store.tail_keys, store.tail_values
    tail = 0 if tail_keys is None else tail_keys.shape[-2]
    bias = None
    if attention_mask is not None:
        bias = _bias(attention_mask, 1, slice(0, store.n_encoded + tail))[:, :, 0]  # [B, 1 or H_kv, T + Tt]
    best, total, stored, plain = triton_decode.decode_attention(
        stored_q, plain_q, store.encoded_keys, store.encoded_values, layer.value_dim, bias, layer.slots.sink_slots,
        store.sink_keys, store.sink_values, tail_keys, tail_values,
    )
    assert plain is not None
    out = layer.codec.from_basis(stored, "value") + plain
    return out / total.clamp(min=torch.finfo(torch.float32).tiny)  # a fully masked row gives 0, not NaN


def _attend_by_codec_kernel(layer, plain_q, attention_mask) -> torch.Tensor | None:
    """Store, exact sinks and tail in one call of the codec's own kernel (`attend_layer`: lowrank's on CPU):
    [B, H_kv, groups * q, Dv], normalised; None where the codec's kernel does not read this step."""
    store = layer.store
    n_store = store.n_encoded + store.n_held  # the held slots (a stack's reduced residual) are read as the store's
    tail_keys, tail_values = store.tail_keys, store.tail_values
    if tail_keys is None:  # nothing appended since the store took everything
        tail_keys = tail_values = plain_q.new_zeros(*plain_q.shape[:2], 0, plain_q.shape[-1])
    bias = None if attention_mask is None else _bias(attention_mask, 1, slice(0, n_store + tail_keys.shape[-2]))
    at = {"positions": layer.slots.positions[:, :, :n_store]} if layer.codec.needs_positions else {}
    return layer.codec.attend_layer(store.encoded_keys, store.encoded_values, plain_q, bias, layer.slots.sink_slots,
                                    store.sink_keys, store.sink_values, tail_keys, tail_values, **at,
                                    held_keys=store.held_keys, held_values=store.held_values)


def _attend_by_cpu_kernel(layer, plain_q, attention_mask) -> torch.Tensor:
    """Store, exact sinks and tail through the C++ kernel in one call: [B, H_kv, groups * q, Dv], normalised. It
    takes the mask rows as they are (row m of a KV head's groups * q query rows reads mask row m % q)."""
    store = layer.store
    tail_keys, tail_values = store.tail_keys, store.tail_values
    if tail_keys is None:  # nothing appended since the store took everything
        tail_keys = tail_values = plain_q.new_zeros(*plain_q.shape[:2], 0, plain_q.shape[-1])
    columns = slice(0, store.n_encoded + tail_keys.shape[-2])
    bias = None if attention_mask is None else _bias(attention_mask, 1, columns)  # [B, 1 or H_kv, q, T + Tt]
    return attend_by_cpu_kernel(
        layer.codec, plain_q, store.encoded_keys, store.encoded_values, layer.value_dim, bias, tail_keys, tail_values,
        sink_slots=layer.slots.sink_slots, sink_keys=store.sink_keys, sink_values=store.sink_values,
    )


def attend_by_cpu_kernel(
    codec: Codec, plain_q: torch.Tensor, encoded_keys: Encoded, encoded_values: Encoded, value_dim: int,
    bias: torch.Tensor | None, tail_keys: torch.Tensor, tail_values: torch.Tensor,
    sink_slots: torch.Tensor | None = None, sink_keys: torch.Tensor | None = None,
    sink_values: torch.Tensor | None = None, spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `plain_q` [B, H_kv, M, D] (scaled, the model's basis) over an encoded store read by the C++
    kernel, its exact sinks at `sink_slots` and a full-precision segment `tail_keys` / `tail_values`
    [B, H_kv, Tt, D] after it, in one call (ops/cpu_decode.py `decode_attention`, whose arguments these are):
    [B, H_kv, M, Dv], normalised. A token layer's store is [B, H_kv, T, ...]; a per-head store's is flat and read
    by `spans` (caches/head_store.py `HeadStore.attend_encoded`)."""
    key_layout, value_layout = codec.kernel_layout("key"), codec.kernel_layout("value")
    assert key_layout is not None and value_layout is not None  # the caller chose the kernel (`store_kernel`)
    # The rotations (and pre_rope's offset turns) the kernel applies itself, where the codec's bases are plain
    # rotations: a few small tensor ops fewer per layer and step.
    key_rotation = value_rotation = turns = None
    if plain_q.shape[2] <= KERNEL_ROTATION_ROWS:
        key_rotation, value_rotation = codec.kernel_rotations(plain_q.shape[-1], value_dim, plain_q.device)
        turns = None if key_rotation is None else codec.kernel_turns(plain_q.device)
    # [B, H_kv, groups * q, O, D]: one per offset of a key group; with key_rotation, the query as it is (O = 1)
    queries = plain_q[:, :, :, None] if key_rotation is not None else codec.kernel_queries(plain_q)
    stored, plain = cpu_decode.decode_attention(
        queries, plain_q, encoded_keys, encoded_values, key_layout, value_layout, value_dim, bias,
        sink_slots, sink_keys, sink_values, tail_keys, tail_values,
        key_rotation=key_rotation, value_rotation=value_rotation, key_turns=turns, spans=spans,
    )
    return (stored if value_rotation is not None else codec.from_basis(stored, "value")) + plain


def store_kernel(layer, query: torch.Tensor, backend: str) -> str | None:
    """Which kernel reads the store segment: "triton", "cpu" or None (the PyTorch loop). `backend` "auto": Triton
    on CUDA and the C++ kernel on CPU, where they read this store; "triton" / "cpu" / "torch": forced."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    if backend in ("auto", "triton") and query.shape[2] == 1:
        # The Triton kernel dequantises on the uniform grid: a Lloyd-Max codebook (int2's default) is read by
        # PyTorch, and so are pre-RoPE keys (one query per offset in a key group, codecs/plane_attention.py).
        codec = layer.codec
        # Nor are keys stored with their positions (lowrank's latents, read by the codec's `key_logits`).
        uniform = (getattr(codec, "codebook", "uniform") == "uniform" and not getattr(codec, "pre_rope", False)
                   and not codec.needs_positions)
        fits = uniform and triton_decode.supports(
            layer.store.encoded_keys, layer.store.encoded_values, layer.store.n_encoded, layer.head_dim, layer.value_dim
        )
        if fits and (backend == "triton" or query.is_cuda):
            return "triton"
    if backend == "triton":
        raise ValueError(
            "backend='triton' needs triton installed, one query per row and a packed int2/int4/int8 store with "
            "power-of-two dims and codebook='uniform'"
        )
    codec = layer.codec
    readable = kernel_layouts(codec, query.device)
    if backend == "cpu":
        if not readable:
            raise ValueError(
                "backend='cpu' needs CPU tensors and a store the kernel reads: int2/int4/int8 with "
                "codebook='uniform' (or 2-bit Lloyd-Max levels), or fp8"
            )
        if not cpu_decode.available():
            raise RuntimeError(
                "backend='cpu': the CPU decode-attention kernel could not be built here (see the warning)"
            )
        return "cpu"
    return "cpu" if readable and cpu_decode.available() else None


def kernel_layouts(codec: Codec, device: torch.device) -> bool:
    """Whether the C++ kernel has a layout for `codec`'s keys and values on `device` (CPU); whether it is built
    here is `cpu_decode.available()`."""
    return device.type == "cpu" and codec.kernel_layout("key") is not None and codec.kernel_layout("value") is not None


def attend_store(
    layer, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, backend: str = "auto"
) -> torch.Tensor:
    """Attention of `query` [B, H_q, q, D] over what `layer` holds (store, sinks, tail): [B, q, H_q, Dv], as
    transformers' attention functions return it. `attention_mask`: [B, 1, q, kv] bool or additive, or None.
    `backend`: how the store is read, one of BACKENDS (`store_kernel`)."""
    codec = layer.codec
    batch, q_heads, q_len, dim = query.shape
    kv_heads = layer.kv_heads
    groups = q_heads // kv_heads
    n_enc = layer.store.n_encoded
    held = layer.store.n_held  # a stack's reduced residual: read by its own codec, not by the store kernels
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] not in (1, kv_heads):
        attention_mask = attention_mask[:, :1]  # one mask for every head
    # Query heads h = k * groups + g share KV head k: [B, H_kv, groups * q, D].
    plain_q = (query.float() * scaling).reshape(batch, kv_heads, groups * q_len, dim)
    kernel = store_kernel(layer, query, backend) if n_enc and not held else None
    out: torch.Tensor | None = None
    if kernel == "cpu":
        out = _attend_by_cpu_kernel(layer, plain_q, attention_mask)
    elif kernel == "triton":
        out = _attend_by_triton(layer, plain_q, codec.key_query(plain_q), attention_mask)
    elif (n_enc or held) and backend != "torch" and codec.layer_kernel:  # the codec's own kernel, where it reads
        out = _attend_by_codec_kernel(layer, plain_q, attention_mask)
    if out is None:  # the PyTorch segments
        out = _attend_in_segments(layer, plain_q, codec.key_query(plain_q), attention_mask, groups)
    out = out.reshape(batch, kv_heads, groups, q_len, -1).reshape(batch, q_heads, q_len, -1)
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _attend_in_segments(layer, plain_q, stored_q, attention_mask, groups: int) -> torch.Tensor:
    """The store (PyTorch blocks), the exact sinks and the tail as segments of one online softmax in PyTorch:
    [B, H_kv, groups * q, Dv], normalised. The reference for the kernels (a codec's own too)."""
    codec, n_enc = layer.codec, layer.store.n_encoded + layer.store.n_held  # store slots: encoded, then held
    softmax = _OnlineSoftmax()
    _store_by_blocks(layer, stored_q, attention_mask, groups, softmax)
    if layer.slots.sink_slots is not None:
        slots = layer.slots.sink_slots
        logits = torch.matmul(plain_q, layer.store.sink_keys.float().transpose(-1, -2))
        bias = _bias(attention_mask, groups, slots.clamp(min=0))
        if bias is not None:
            logits = logits + bias
        absent = (slots < 0) | (slots >= n_enc)  # no sink, or one still in the tail (attended there)
        logits = logits.masked_fill(absent[:, :, None, :], float("-inf"))
        softmax.add(logits, layer.store.sink_values.float(), stored_basis=False)
    if layer.store.tail_keys is not None and layer.store.tail_keys.shape[-2] > 0:
        logits = torch.matmul(plain_q, layer.store.tail_keys.float().transpose(-1, -2))
        bias = _bias(attention_mask, groups, slice(n_enc, n_enc + layer.store.tail_keys.shape[-2]))
        if bias is not None:
            logits = logits + bias
        softmax.add(logits, layer.store.tail_values.float(), stored_basis=False)
    out = softmax.plain if softmax.plain is not None else 0
    if softmax.stored is not None:
        out = out + codec.from_basis(softmax.stored, "value")
    return out / softmax.total.clamp(min=torch.finfo(torch.float32).tiny)  # a fully masked row gives 0, not NaN
