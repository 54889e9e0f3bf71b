"""Decode attention that reads a layer's encoded store a block at a time, with an online softmax.

Decoding the whole store and concatenating it with the tail at every step touches every stored byte several times
in float32 and, for rotated codecs, applies the inverse rotation to every stored token. Here each block of
`STORE_BLOCK` tokens is decoded in the codec's storage basis only (the query is rotated once instead, and the
output once at the end), its logits folded into a running max and sum (flash-decoding, Dao et al. 2023), and
dropped: the transient memory is one block, not the whole cache in float32. The exact attention sinks and the
full-precision tail are two more segments of the same softmax. `CompressedLayer._full` + SDPA is the reference.
"""

from __future__ import annotations

import torch

from ..codecs.base import Encoded

STORE_BLOCK = 1024  # tokens decoded at a time (rounded up to a whole number of the codec's token blocks)


def slice_encoded(encoded: Encoded, start: int, end: int, tokens: int) -> Encoded:
    """Tokens [start, end) of an encoding of `tokens` tokens; tensors stored per group of g tokens are cut at
    start // g and end // g (the caller keeps both on group boundaries)."""
    out = {}
    for name, tensor in encoded.items():
        per_entry = tokens // tensor.shape[2]
        out[name] = tensor[:, :, start // per_entry : end // per_entry]
    return out


class _OnlineSoftmax:
    """Running max, sum and two outputs (storage basis and plain) over segments of keys, for [B, H_kv, n, *]."""

    def __init__(self):
        self.max = self.total = self.stored = self.plain = None

    def add(self, logits: torch.Tensor, values: torch.Tensor, stored_basis: bool) -> None:
        """logits [B, H_kv, n, k] (masked entries -inf), values [B, H_kv, k, Dv] in float32."""
        block_max = logits.amax(-1, keepdim=True)
        new_max = block_max if self.max is None else torch.maximum(self.max, block_max)
        safe = new_max.masked_fill(new_max == float("-inf"), 0.0)  # a row masked so far: exp(-inf - 0) = 0
        probs = torch.exp(logits - safe)
        if self.max is not None:
            rescale = torch.exp(self.max - safe)
            self.total = self.total * rescale
            self.stored = None if self.stored is None else self.stored * rescale
            self.plain = None if self.plain is None else self.plain * rescale
        self.max = new_max
        self.total = probs.sum(-1, keepdim=True) if self.total is None else self.total + probs.sum(-1, keepdim=True)
        part = torch.matmul(probs, values)
        if stored_basis:
            self.stored = part if self.stored is None else self.stored + part
        else:
            self.plain = part if self.plain is None else self.plain + part


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


def attend_store(layer, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of `query` [B, H_q, q, D] over what `layer` holds (store, sinks, tail): [B, q, H_q, Dv], as
    transformers' attention functions return it. `attention_mask`: [B, 1, q, kv] bool or additive, or None."""
    codec = layer.codec
    batch, q_heads, q_len, dim = query.shape
    kv_heads = layer.kv_heads
    groups = q_heads // kv_heads
    n_enc = layer.n_encoded
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] not in (1, kv_heads):
        attention_mask = attention_mask[:, :1]  # one mask for every head
    # Query heads h = k * groups + g share KV head k: [B, H_kv, groups * q, D].
    plain_q = (query.float() * scaling).reshape(batch, kv_heads, groups * q_len, dim)
    stored_q = codec.to_basis(plain_q, "key")
    softmax = _OnlineSoftmax()
    unit = max(codec.token_block("key"), codec.token_block("value"))
    block = -(-STORE_BLOCK // unit) * unit
    for start in range(0, n_enc, block):
        end = min(start + block, n_enc)
        keys = codec.decode_in_basis(slice_encoded(layer.encoded_keys, start, end, n_enc), "key", torch.float32)
        values = codec.decode_in_basis(slice_encoded(layer.encoded_values, start, end, n_enc), "value", torch.float32)
        logits = torch.matmul(stored_q, keys.transpose(-1, -2))
        bias = _bias(attention_mask, groups, slice(start, end))
        if bias is not None:
            logits = logits + bias
        if layer.sink_slots is not None:  # sinks are attended exactly below, not in their decoded form
            inside = (layer.sink_slots >= start) & (layer.sink_slots < end)
            hidden = torch.zeros(batch, kv_heads, end - start + 1, dtype=torch.bool, device=logits.device)
            hidden.scatter_(2, torch.where(inside, layer.sink_slots - start, end - start), True)
            logits = logits.masked_fill(hidden[:, :, None, : end - start], float("-inf"))
        softmax.add(logits, values, stored_basis=True)
    if layer.sink_slots is not None:
        slots = layer.sink_slots
        logits = torch.matmul(plain_q, layer.sink_keys.float().transpose(-1, -2))
        bias = _bias(attention_mask, groups, slots.clamp(min=0))
        if bias is not None:
            logits = logits + bias
        absent = (slots < 0) | (slots >= n_enc)  # no sink, or one still in the tail (attended there)
        logits = logits.masked_fill(absent[:, :, None, :], float("-inf"))
        softmax.add(logits, layer.sink_values.float(), stored_basis=False)
    if layer.tail_keys is not None and layer.tail_keys.shape[-2] > 0:
        logits = torch.matmul(plain_q, layer.tail_keys.float().transpose(-1, -2))
        bias = _bias(attention_mask, groups, slice(n_enc, n_enc + layer.tail_keys.shape[-2]))
        if bias is not None:
            logits = logits + bias
        softmax.add(logits, layer.tail_values.float(), stored_basis=False)
    out = softmax.plain if softmax.plain is not None else 0
    if softmax.stored is not None:
        out = out + codec.from_basis(softmax.stored, "value")
    out = out / softmax.total.clamp(min=torch.finfo(torch.float32).tiny)  # a fully masked row gives 0, not NaN
    out = out.reshape(batch, kv_heads, groups, q_len, -1).reshape(batch, q_heads, q_len, -1)
    return out.transpose(1, 2).contiguous().to(query.dtype)
