"""Decode attention over a bit-packed int2/int4/int8 store in one Triton kernel, dequantising in registers.

Flash-decoding (Dao et al. 2023): the store's tokens are split across programs as well as (batch, KV head), each
program keeps a running max, sum and output over its tiles, and the partials are merged afterwards, so a batch-1
decode still fills the GPU. Codes are read packed (bits / 8 bytes per value), with one scale and zero point per
group (KIVI layout: keys per channel over `token_group` tokens, or per token over `channel_group` channels).
`caches/store_attention.py` runs this on CUDA and keeps the PyTorch loop as the reference; on CPU the kernel runs
only under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

import torch

from .cpu_decode import packed_rows, row_stride

SUPPORTED_BITS = (2, 4, 8)
# Built on first use: Triton reads TRITON_INTERPRET when it is imported (the triton extra ships no types: Any).
triton: Any = None
tl: Any = None
_dequantise: Any = None
_online: Any = None


def available() -> bool:
    """Whether triton is installed (optional: pip install 'hf-kvcompress[triton]')."""
    return importlib.util.find_spec("triton") is not None


@cache
def _kernel():
    """The jitted kernel, built on first use (importing triton then, not with the package)."""
    global triton, tl, _dequantise, _online  # jitted kernels find the functions they call among the module's globals
    import triton  # the triton extra, imported when the kernel is first built
    import triton.language as tl

    @triton.jit
    def _dequantise(codes, scales, zeros, row, codes_row, scales_row, row_bytes, s_d, t_offs, t_valid, offs,
                    BITS: tl.constexpr, TOKEN_GROUP: tl.constexpr, CHANNEL_GROUP: tl.constexpr):
        """A tile [BLOCK_T, len(offs)] of keys or values: each value's byte, its bits in it, and its group's scale
        and zero point. Row (b, h) starts `codes_row` bytes and `scales_row` scales after the previous one (a room's
        view: its spare slots lie between the rows)."""
        UNIT: tl.constexpr = 8 // BITS  # values per byte
        byte = tl.load(codes + row * codes_row + t_offs[:, None] * row_bytes + (offs // UNIT)[None, :],
                       mask=t_valid[:, None], other=0).to(tl.int32)
        code = (byte >> ((offs % UNIT) * BITS)[None, :]) & ((1 << BITS) - 1)
        group = row * scales_row + (t_offs // TOKEN_GROUP)[:, None] * s_d + (offs // CHANNEL_GROUP)[None, :]
        scale = tl.load(scales + group, mask=t_valid[:, None], other=0.0).to(tl.float32)
        zero = tl.load(zeros + group, mask=t_valid[:, None], other=0.0).to(tl.float32)
        return code.to(tl.float32) * scale + zero

    @triton.jit
    def _online(logits, values, run_max, run_sum, acc):
        """Fold a tile's logits [BLOCK_M, BLOCK_T] and values [BLOCK_T, DV] into the running max, sum, output."""
        new_max = tl.maximum(run_max, tl.max(logits, 1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(logits - safe[:, None])
        rescale = tl.exp(run_max - safe)
        acc = acc * rescale[:, None] + tl.dot(probs, values)
        return new_max, run_sum * rescale + tl.sum(probs, 1), acc

    @triton.jit
    def _decode_attention_kernel(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bias,
        pq, sink_k, sink_v, sink_slots, tail_k, tail_v,
        out_max, out_sum, out_acc, out_plain,
        M, T, tokens_per_split, store_splits, heads, k_row_bytes, v_row_bytes, k_rows, ks_rows, ks_d, v_rows,
        vs_rows, vs_d,
        bias_b, bias_h, S, sink_b, sink_h, sink_t, Tt, tail_b, tail_h, tail_t,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
        K_BITS: tl.constexpr, K_TOKEN_GROUP: tl.constexpr, K_CHANNEL_GROUP: tl.constexpr,
        V_BITS: tl.constexpr, V_TOKEN_GROUP: tl.constexpr, V_CHANNEL_GROUP: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        # Programs (row, split) for split < store_splits read the store's tokens of their split; one more program
        # per row (split == store_splits, when the grid has it) reads the exact sinks and the recent tail with the
        # plain query: its output stays in the model's basis (out_plain), the store's in the storage basis.
        row = tl.program_id(0)  # batch * KV heads + head
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        batch_row = row // heads
        head = row % heads
        bias_row = bias + batch_row * bias_b + head * bias_h  # [T + Tt] float32: the mask's columns (-inf hidden)
        m_offs = tl.arange(0, BLOCK_M)
        d_offs = tl.arange(0, D)
        dv_offs = tl.arange(0, DV)
        s_offs = tl.arange(0, BLOCK_S)
        m_valid = m_offs < M
        run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, DV), tl.float32)
        part = row * splits + split
        if HAS_SINKS:  # [BLOCK_S] the sinks' slots in the store (-1: no sink there)
            slots = tl.load(sink_slots + row * S + s_offs, mask=s_offs < S, other=-1)
        if split < store_splits:
            query = tl.load(q + row * M * D + m_offs[:, None] * D + d_offs[None, :], mask=m_valid[:, None],
                            other=0.0)
            start = split * tokens_per_split
            stop = tl.minimum(start + tokens_per_split, T)
            for t0 in range(start, stop, BLOCK_T):
                t_offs = t0 + tl.arange(0, BLOCK_T)
                t_valid = t_offs < stop
                keys = _dequantise(k_codes, k_scale, k_zero, row, k_rows, ks_rows, k_row_bytes, ks_d, t_offs, t_valid,
                                   d_offs, K_BITS, K_TOKEN_GROUP, K_CHANNEL_GROUP)  # [BLOCK_T, D]
                logits = tl.dot(query, tl.trans(keys))  # [BLOCK_M, BLOCK_T]
                if HAS_BIAS:
                    logits += tl.load(bias_row + t_offs, mask=t_valid, other=float("-inf"))[None, :]
                if HAS_SINKS:  # a sink's slot is attended exactly by the plain program, not in its decoded form
                    t_valid = t_valid & (tl.sum((t_offs[:, None] == slots[None, :]).to(tl.int32), 1) == 0)
                logits = tl.where(t_valid[None, :], logits, float("-inf"))
                values = _dequantise(v_codes, v_scale, v_zero, row, v_rows, vs_rows, v_row_bytes, vs_d, t_offs, t_valid,
                                     dv_offs, V_BITS, V_TOKEN_GROUP, V_CHANNEL_GROUP)  # [BLOCK_T, DV]
                run_max, run_sum, acc = _online(logits, values, run_max, run_sum, acc)
            tl.store(out_acc + (row * store_splits + split) * M * DV + m_offs[:, None] * DV + dv_offs[None, :], acc,
                     mask=m_valid[:, None])
        else:
            query = tl.load(pq + row * M * D + m_offs[:, None] * D + d_offs[None, :], mask=m_valid[:, None],
                            other=0.0)
            if HAS_SINKS:  # a sink whose slot is still in the tail (or no sink) is attended there, or not at all
                s_valid = (s_offs < S) & (slots >= 0) & (slots < T)
                s_at = sink_k + batch_row * sink_b + head * sink_h + s_offs[:, None] * sink_t + d_offs[None, :]
                s_keys = tl.load(s_at, mask=s_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_S, D]
                s_logits = tl.dot(query, tl.trans(s_keys), input_precision="ieee")
                if HAS_BIAS:
                    s_logits += tl.load(bias_row + tl.where(s_valid, slots, 0), mask=s_valid,
                                      other=float("-inf"))[None, :]
                s_logits = tl.where(s_valid[None, :], s_logits, float("-inf"))
                s_at = sink_v + batch_row * sink_b + head * sink_h + s_offs[:, None] * sink_t + dv_offs[None, :]
                s_values = tl.load(s_at, mask=s_valid[:, None], other=0.0).to(tl.float32)
                run_max, run_sum, acc = _online(s_logits, s_values, run_max, run_sum, acc)
            for t0 in range(0, Tt, BLOCK_T):
                t_offs = t0 + tl.arange(0, BLOCK_T)
                t_valid = t_offs < Tt
                at = tail_k + batch_row * tail_b + head * tail_h + t_offs[:, None] * tail_t + d_offs[None, :]
                keys = tl.load(at, mask=t_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_T, D]
                logits = tl.dot(query, tl.trans(keys), input_precision="ieee")
                if HAS_BIAS:
                    logits += tl.load(bias_row + T + t_offs, mask=t_valid, other=float("-inf"))[None, :]
                logits = tl.where(t_valid[None, :], logits, float("-inf"))
                at = tail_v + batch_row * tail_b + head * tail_h + t_offs[:, None] * tail_t + dv_offs[None, :]
                values = tl.load(at, mask=t_valid[:, None], other=0.0).to(tl.float32)
                run_max, run_sum, acc = _online(logits, values, run_max, run_sum, acc)
            tl.store(out_plain + row * M * DV + m_offs[:, None] * DV + dv_offs[None, :], acc, mask=m_valid[:, None])
        tl.store(out_max + part * M + m_offs, run_max, mask=m_valid)
        tl.store(out_sum + part * M + m_offs, run_sum, mask=m_valid)

    return _decode_attention_kernel


def _layout(encoded: dict, tokens: int, dim: int) -> tuple[int, int, int]:
    """(bits, token_group, channel_group) of a {codes, scale, zero} encoding, read from its shapes."""
    bits = 8 * encoded["codes"].shape[-1] // dim
    scale = encoded["scale"]
    return bits, tokens // scale.shape[2], dim // scale.shape[3]


def supports(encoded_keys: dict, encoded_values: dict, tokens: int, dim: int, value_dim: int) -> bool:
    """Whether the kernel reads this store: packed codes with a scale and zero per group, power-of-two dims."""
    packed = {"codes", "scale", "zero"}
    if not available() or set(encoded_keys) != packed or set(encoded_values) != packed:
        return False
    if dim & (dim - 1) or value_dim & (value_dim - 1) or dim < 16 or value_dim < 16:
        return False
    return (_layout(encoded_keys, tokens, dim)[0] in SUPPORTED_BITS
            and _layout(encoded_values, tokens, value_dim)[0] in SUPPORTED_BITS)


def decode_attention_partials(
    query: torch.Tensor, encoded_keys: dict, encoded_values: dict, value_dim: int, bias: torch.Tensor | None,
    block_t: int = 64, tokens_per_split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax partials of `query` [B, H_kv, M, D] (scaled, in the store's basis) over the store's T tokens.

    `bias` [B, H_kv or 1, T] float32 is added to the logits (the mask, -inf for hidden slots). Returns the running max
    and sum [B, H_kv, M, 1] and the unnormalised output [B, H_kv, M, Dv], merged over the token splits."""
    best, total, stored, _ = _launch(query, None, encoded_keys, encoded_values, value_dim, bias, None, None, None,
                                     None, None, block_t, tokens_per_split)
    return best, total, stored


def decode_attention(
    query: torch.Tensor, plain_query: torch.Tensor, encoded_keys: dict, encoded_values: dict, value_dim: int,
    bias: torch.Tensor | None, sink_slots: torch.Tensor | None, sink_keys: torch.Tensor | None,
    sink_values: torch.Tensor | None, tail_keys: torch.Tensor | None, tail_values: torch.Tensor | None,
    block_t: int = 64, tokens_per_split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole layer's decode attention in one launch: the store (through `query`, in its basis), the exact sinks
    and the recent tail (through `plain_query` [B, H_kv, M, D], the model's basis), as one softmax.

    `bias` [B, H_kv or 1, T + Tt] float32: the mask's columns over the store then the tail (a sink reads its slot's
    column). `sink_slots` [B, H_kv, S] (-1: none; a slot >= T is a sink still in the tail, attended there) with
    `sink_keys`/`sink_values` [B, H_kv, S, D]; `tail_keys`/`tail_values` [B, H_kv, Tt, D] (None: no tail). The
    store's slots that hold a sink are hidden in the store. Returns the max and sum [B, H_kv, M, 1], the store's
    output in its basis and the plain output [B, H_kv, M, Dv], both relative to the max (unnormalised)."""
    return _launch(query, plain_query, encoded_keys, encoded_values, value_dim, bias, sink_slots, sink_keys,
                   sink_values, tail_keys, tail_values, block_t, tokens_per_split)


def _segment(keys: torch.Tensor | None, values: torch.Tensor | None, placeholder: torch.Tensor):
    """A plain segment (the exact sinks, the tail) as the kernel reads it: keys and values [B, H, n, D] with their
    last axis contiguous and one set of strides for both (copied where not), their n and (batch, head, token)
    strides in elements; an absent or empty segment gives the placeholder, 0 and zero strides."""
    if keys is None or values is None or keys.shape[-2] == 0:
        return placeholder, placeholder, 0, (0, 0, 0)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    return keys, values, keys.shape[-2], (keys.stride(0), keys.stride(1), keys.stride(2))


def _launch(query, plain_query, encoded_keys, encoded_values, value_dim, bias, sink_slots, sink_keys, sink_values,
            tail_keys, tail_values, block_t, tokens_per_split):
    batch, heads, m, dim = query.shape
    tokens = encoded_keys["codes"].shape[2]
    k_bits, k_tg, k_cg = _layout(encoded_keys, tokens, dim)
    v_bits, v_tg, v_cg = _layout(encoded_values, tokens, value_dim)
    if tokens_per_split is None:  # enough programs to fill a GPU: about 4 per SM of 132 over batch x heads
        want = max(1, 512 // (batch * heads))
        tokens_per_split = max(block_t, -(-tokens // want))
    tokens_per_split = -(-tokens_per_split // block_t) * block_t
    store_splits = -(-tokens // tokens_per_split)
    plain = plain_query is not None
    splits = store_splits + plain
    rows = batch * heads
    device = query.device
    out_max = torch.empty(rows, splits, m, device=device, dtype=torch.float32)
    out_sum = torch.empty_like(out_max)
    out_acc = torch.empty(rows, store_splits, m, value_dim, device=device, dtype=torch.float32)
    out_plain = torch.empty(rows, m, value_dim, device=device, dtype=torch.float32) if plain else out_acc
    q = query.float().contiguous()
    pq = plain_query.float().contiguous() if plain else q
    kc, ks, kz = packed_rows(encoded_keys)  # a room's view read in place, by its rows' stride, as on CPU
    vc, vs, vz = packed_rows(encoded_values)
    if bias is not None:
        bias = bias.float()
        if bias.stride(-1) != 1:
            bias = bias.contiguous()
    bias_b, bias_h = (bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0) if bias is not None else (0, 0)
    has_sinks = plain and sink_slots is not None
    slots = sink_slots.to(torch.int32).contiguous() if has_sinks else out_max
    sink_k, sink_v, sinks, sink_strides = _segment(sink_keys if has_sinks else None, sink_values, out_max)
    tail_k, tail_v, tail, tail_strides = _segment(tail_keys if plain else None, tail_values, out_max)
    kernel = _kernel()
    block_m = max(16, triton.next_power_of_2(m))
    block_s = max(16, triton.next_power_of_2(max(sinks, 1)))
    kernel[(rows, splits)](
        q, kc, ks, kz, vc, vs, vz, bias if bias is not None else out_max,
        pq, sink_k, sink_v, slots, tail_k, tail_v,
        out_max, out_sum, out_acc, out_plain,
        m, tokens, tokens_per_split, store_splits, heads, kc.shape[-1], vc.shape[-1], row_stride(kc), row_stride(ks),
        ks.shape[3], row_stride(vc), row_stride(vs), vs.shape[3], bias_b, bias_h,
        sinks, *sink_strides, tail, *tail_strides,
        D=dim, DV=value_dim, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_S=block_s,
        K_BITS=k_bits, K_TOKEN_GROUP=k_tg, K_CHANNEL_GROUP=k_cg,
        V_BITS=v_bits, V_TOKEN_GROUP=v_tg, V_CHANNEL_GROUP=v_cg,
        HAS_BIAS=bias is not None, HAS_SINKS=has_sinks,
    )
    # Merge the programs (one with no visible token has max -inf and sum 0: it weighs nothing).
    best = out_max.amax(1, keepdim=True)
    weight = torch.exp(out_max - best.masked_fill(best == float("-inf"), 0.0))  # [rows, splits, M]
    total = (out_sum * weight).sum(1)
    acc = (out_acc * weight[:, :store_splits, :, None]).sum(1)
    shape = (batch, heads, m)
    plain_acc = (out_plain * weight[:, store_splits, :, None]).reshape(*shape, value_dim) if plain else None
    return best.reshape(*shape, 1), total.reshape(*shape, 1), acc.reshape(*shape, value_dim), plain_acc

