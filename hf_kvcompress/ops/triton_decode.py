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

SUPPORTED_BITS = (2, 4, 8)
# Built on first use: Triton reads TRITON_INTERPRET when it is imported (the triton extra ships no types: Any).
triton: Any = None
tl: Any = None
_dequantise: Any = None


def available() -> bool:
    """Whether triton is installed (optional: pip install 'hf-kvcompress[triton]')."""
    return importlib.util.find_spec("triton") is not None


@cache
def _kernel():
    """The jitted kernel, built on first use (importing triton then, not with the package)."""
    global triton, tl, _dequantise  # jitted kernels find the functions they call among the module's globals
    import triton  # the triton extra, imported when the kernel is first built
    import triton.language as tl

    @triton.jit
    def _dequantise(codes, scales, zeros, row, T, row_bytes, s_t, s_d, t_offs, t_valid, offs,
                    BITS: tl.constexpr, TOKEN_GROUP: tl.constexpr, CHANNEL_GROUP: tl.constexpr):
        """A tile [BLOCK_T, len(offs)] of keys or values: each value's byte, its bits in it, and its group's scale
        and zero point."""
        UNIT: tl.constexpr = 8 // BITS  # values per byte
        byte = tl.load(codes + row * T * row_bytes + t_offs[:, None] * row_bytes + (offs // UNIT)[None, :],
                       mask=t_valid[:, None], other=0).to(tl.int32)
        code = (byte >> ((offs % UNIT) * BITS)[None, :]) & ((1 << BITS) - 1)
        group = row * s_t * s_d + (t_offs // TOKEN_GROUP)[:, None] * s_d + (offs // CHANNEL_GROUP)[None, :]
        scale = tl.load(scales + group, mask=t_valid[:, None], other=0.0).to(tl.float32)
        zero = tl.load(zeros + group, mask=t_valid[:, None], other=0.0).to(tl.float32)
        return code.to(tl.float32) * scale + zero

    @triton.jit
    def _decode_attention_kernel(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bias,
        out_max, out_sum, out_acc,
        M, T, tokens_per_split, k_row_bytes, v_row_bytes, ks_t, ks_d, vs_t, vs_d,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
        K_BITS: tl.constexpr, K_TOKEN_GROUP: tl.constexpr, K_CHANNEL_GROUP: tl.constexpr,
        V_BITS: tl.constexpr, V_TOKEN_GROUP: tl.constexpr, V_CHANNEL_GROUP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        row = tl.program_id(0)  # batch * KV heads + head
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        m_offs = tl.arange(0, BLOCK_M)
        d_offs = tl.arange(0, D)
        dv_offs = tl.arange(0, DV)
        m_valid = m_offs < M
        query = tl.load(q + row * M * D + m_offs[:, None] * D + d_offs[None, :], mask=m_valid[:, None], other=0.0)
        run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, DV), tl.float32)
        start = split * tokens_per_split
        stop = tl.minimum(start + tokens_per_split, T)
        for t0 in range(start, stop, BLOCK_T):
            t_offs = t0 + tl.arange(0, BLOCK_T)
            t_valid = t_offs < stop
            keys = _dequantise(k_codes, k_scale, k_zero, row, T, k_row_bytes, ks_t, ks_d, t_offs, t_valid, d_offs,
                               K_BITS, K_TOKEN_GROUP, K_CHANNEL_GROUP)  # [BLOCK_T, D]
            logits = tl.dot(query, tl.trans(keys))  # [BLOCK_M, BLOCK_T]
            if HAS_BIAS:
                logits += tl.load(bias + row * T + t_offs, mask=t_valid, other=float("-inf"))[None, :]
            logits = tl.where(t_valid[None, :], logits, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(logits, 1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(logits - safe[:, None])
            rescale = tl.exp(run_max - safe)
            values = _dequantise(v_codes, v_scale, v_zero, row, T, v_row_bytes, vs_t, vs_d, t_offs, t_valid, dv_offs,
                                 V_BITS, V_TOKEN_GROUP, V_CHANNEL_GROUP)  # [BLOCK_T, DV]
            acc = acc * rescale[:, None] + tl.dot(probs, values)
            run_sum = run_sum * rescale + tl.sum(probs, 1)
            run_max = new_max
        part = row * splits + split
        tl.store(out_max + part * M + m_offs, run_max, mask=m_valid)
        tl.store(out_sum + part * M + m_offs, run_sum, mask=m_valid)
        tl.store(out_acc + part * M * DV + m_offs[:, None] * DV + dv_offs[None, :], acc, mask=m_valid[:, None])

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

    `bias` [B, H_kv, T] float32 is added to the logits (the mask, -inf for hidden slots). Returns the running max
    and sum [B, H_kv, M, 1] and the unnormalised output [B, H_kv, M, Dv], merged over the token splits."""
    batch, heads, m, dim = query.shape
    tokens = encoded_keys["codes"].shape[2]
    k_bits, k_tg, k_cg = _layout(encoded_keys, tokens, dim)
    v_bits, v_tg, v_cg = _layout(encoded_values, tokens, value_dim)
    if tokens_per_split is None:  # enough programs to fill a GPU: about 4 per SM of 132 over batch x heads
        want = max(1, 512 // (batch * heads))
        tokens_per_split = max(block_t, -(-tokens // want))
    tokens_per_split = -(-tokens_per_split // block_t) * block_t
    splits = -(-tokens // tokens_per_split)
    rows = batch * heads
    out_max = torch.empty(rows, splits, m, device=query.device, dtype=torch.float32)
    out_sum = torch.empty_like(out_max)
    out_acc = torch.empty(rows, splits, m, value_dim, device=query.device, dtype=torch.float32)
    kernel = _kernel()
    block_m = max(16, triton.next_power_of_2(m))
    q = query.float().contiguous()
    kc, vc = encoded_keys["codes"].contiguous(), encoded_values["codes"].contiguous()
    ks, kz = encoded_keys["scale"].contiguous(), encoded_keys["zero"].contiguous()
    vs, vz = encoded_values["scale"].contiguous(), encoded_values["zero"].contiguous()
    bias_arg = bias.float().contiguous() if bias is not None else out_max
    kernel[(rows, splits)](
        q, kc, ks, kz, vc, vs, vz, bias_arg, out_max, out_sum, out_acc,
        m, tokens, tokens_per_split, kc.shape[-1], vc.shape[-1], ks.shape[2], ks.shape[3], vs.shape[2], vs.shape[3],
        D=dim, DV=value_dim, BLOCK_M=block_m, BLOCK_T=block_t,
        K_BITS=k_bits, K_TOKEN_GROUP=k_tg, K_CHANNEL_GROUP=k_cg,
        V_BITS=v_bits, V_TOKEN_GROUP=v_tg, V_CHANNEL_GROUP=v_cg,
        HAS_BIAS=bias is not None,
    )
    # Merge the splits (a split with no visible token has max -inf and sum 0: it weighs nothing).
    best = out_max.amax(1, keepdim=True)
    safe = best.masked_fill(best == float("-inf"), 0.0)
    weight = torch.exp(out_max - safe)  # [rows, splits, M]
    total = (out_sum * weight).sum(1)
    acc = (out_acc * weight[..., None]).sum(1)
    shape = (batch, heads, m)
    return best.reshape(*shape, 1), total.reshape(*shape, 1), acc.reshape(*shape, value_dim)
