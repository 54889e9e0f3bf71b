"""An attention function that also reports how much attention each cached token received.

Policies such as H2O rank tokens by attention, which SDPA never returns. This function runs SDPA for the output
and, only when a cache layer asks for it, recomputes softmax(QK^T) in blocks of queries to sum it per key, so the
full prefill attention matrix is never materialised at once. A layer may ask for the step's newest queries
instead (Expected Attention models the next queries from them): they exist only here.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..caches.requests import MASK_KEY, OBSERVER_KEY, STORE_KEY
from .compat import text_config
from .hidden_states import offer_hidden_states

ATTENTION_NAME = "kvcompress_sdpa"
# Queries per block of the statistics: a block's logits stay a few MiB, so softmax and the sum read them back from
# cache instead of memory (timings in docs/benchmark-notes.md).
QUERY_BLOCK = 32


def attention_received(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap=None,
    newest_queries: int | None = None,
    reduction: str = "sum",
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention each key received from the step's queries (the `newest_queries` last ones, or all), reduced by
    `reduction` ("sum" or "max") over queries and over the query heads of its KV group: [B, H_kv, kv].

    `query_mask` [B, q] leaves queries out (padding inside a reconstruction chunk)."""
    if reduction not in ("sum", "max"):
        raise ValueError(f"reduction must be 'sum' or 'max', got {reduction!r}")
    full_q = query.shape[2]
    if newest_queries is not None and newest_queries < full_q:
        query = query[:, :, full_q - newest_queries :]
        if attention_mask is not None and attention_mask.shape[2] == full_q:
            attention_mask = attention_mask[:, :, full_q - newest_queries :]
        if query_mask is not None:
            query_mask = query_mask[:, full_q - newest_queries :]
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    # Query heads h = k * groups + g share KV head k: one [g * n, D] x [D, kv] product per KV head reads the keys
    # in place (broadcasting the keys over g instead made matmul copy them g times, at every decode step).
    queries = (query.float() * scaling).view(batch, kv_heads, groups, q_len, dim)
    keys_t = key.float().transpose(-1, -2)  # [B, H_kv, D, kv]
    offset = kv_len - q_len  # query i sits at key slot offset + i (queries aligned to the end of the keys)
    causal = _future_hidden(attention_mask, offset, q_len)
    total = torch.zeros(batch, kv_heads, kv_len, dtype=torch.float32, device=query.device)
    # One block's logits and probabilities live in a buffer sized for the widest block, reused: fresh blocks of
    # growing width each came from the allocator, which kept their pages resident after the prefill.
    widest = batch * kv_heads * groups * min(q_len, QUERY_BLOCK) * kv_len
    scratch = torch.empty(2, widest, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, q_len)
        n = end - start
        # A causal block never sees past its last query's own slot: the keys after it get no attention from it,
        # so they are left out of the product (half of a prefill's work) instead of masked.
        cols = offset + end if causal else kv_len
        block_q = queries[:, :, :, start:end].reshape(batch, kv_heads, groups * n, dim)
        size = batch * kv_heads * groups * n * cols
        logits = scratch[0, :size].view(batch, kv_heads, groups * n, cols)
        torch.matmul(block_q, keys_t[..., :cols], out=logits)
        logits = logits.view(batch, kv_heads, groups, n, cols)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if attention_mask is None:  # SDPA's implicit causal mask: only the block's own new keys can be ahead
            q_pos = torch.arange(start, end, device=query.device)[:, None] + offset
            ahead = torch.arange(offset + start, cols, device=query.device)[None, :] > q_pos
            logits[..., offset + start :].masked_fill_(ahead, float("-inf"))
        else:
            block = attention_mask[:, :, start:end, :cols][:, :, None]  # [B, 1, 1, n, cols]
            if block.dtype == torch.bool:
                logits.masked_fill_(~block, float("-inf"))
            else:  # additive; a key at the dtype's minimum is hidden, so a fully hidden (padding) query gives none
                logits.add_(block.float()).masked_fill_(block <= torch.finfo(block.dtype).min / 2, float("-inf"))
        probs = torch.softmax(logits, dim=-1, out=scratch[1, :size].view(logits.shape))
        if attention_mask is not None:
            probs.nan_to_num_(0.0)  # fully masked (padding) queries give no attention
        if query_mask is not None:
            probs.mul_(query_mask[:, None, None, start:end, None].to(probs.dtype))
        seen = total[..., :cols]
        if reduction == "sum":
            seen += probs.sum(dim=(2, 3))
        else:
            torch.maximum(seen, probs.amax(dim=(2, 3)), out=seen)
    return total


def _future_hidden(attention_mask: torch.Tensor | None, offset: int, q_len: int) -> bool:
    """Whether no query may attend to a key after its own slot `offset + i`, so the keys after a query block's
    last slot can be left out of its product. True without a mask (SDPA's causal mask) and for a single block
    (it reads every key anyway); a mask is asked once per call, for the regions that would be left out: a
    bidirectional or prefix mask keeps every key."""
    if attention_mask is None or q_len <= QUERY_BLOCK:
        return True
    kv_len = offset + q_len
    skipped = []
    for start in range(0, q_len, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, q_len)
        region = attention_mask[:, :, start:end, offset + end : kv_len]
        if attention_mask.dtype != torch.bool:  # additive: a hidden key carries the dtype's minimum (or -inf)
            region = region > torch.finfo(region.dtype).min / 2
        skipped.append(region.any())
    return not bool(torch.stack(skipped).any())


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, plus attention statistics for the cache layer that registered an observer in `kwargs`."""
    request = kwargs.pop(OBSERVER_KEY, None)
    own_mask = kwargs.pop(MASK_KEY, None)
    store = kwargs.pop(STORE_KEY, None)
    if store is not None:
        store.reached = True
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if own_mask is not None:  # the layer keeps what the shared mask cannot describe (see caches/padding.py)
        own_mask.used = True
        attention_mask, own_mask.mask = own_mask.mask, None  # the cache does not keep it: its bytes are exact
        if attention_mask.shape[1] not in (1, query.shape[1]):  # one mask per KV head (head budgets): per query head
            attention_mask = attention_mask.repeat_interleave(query.shape[1] // attention_mask.shape[1], dim=1)
    if store is not None and kwargs.get("softcap") is None and request is None:
        store.used = True
        if store.fused:  # read the encoded store a block at a time (caches/store_attention.py)
            return store.layer.attend(query, attention_mask, scale), None
    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    if request is not None and request.queries:  # Expected Attention models the next queries from these
        newest = query.shape[2] if request.newest_queries is None else min(request.newest_queries, query.shape[2])
        request.deliver(query[:, :, query.shape[2] - newest :].float() * scale)
    elif request is not None:
        mask = attention_mask
        if mask is not None and mask.dim() == 4 and mask.shape[1] not in (1, query.shape[1]):
            mask = mask[:, :1]
        request.deliver(attention_received(
            query, key, mask, scale, kwargs.get("softcap"), request.newest_queries, request.reduction,
            request.query_mask,
        ))
    return output, None


def register() -> str:
    """Make 'kvcompress_sdpa' known to transformers (attention function and its SDPA-style mask); idempotent."""
    AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def engage(config) -> str | None:
    """Switch the model whose config is `config` from transformers' SDPA to 'kvcompress_sdpa', which is that SDPA
    call (the same arguments, the same mask function) whenever no cache layer asks for more, so nothing a model
    answers changes, and a cache that asks is served. Any other implementation (eager, flash, flex) is left as it
    is: it would answer differently. Returns what the decoder's attention now runs (None without a config).

    transformers looks the attention function up by name in each attention forward, after the cache's `update`:
    a switch made while a cache layer updates already applies to that layer's attention."""
    if config is None:
        return None
    decoder = text_config(config)
    name = getattr(decoder, "_attn_implementation", None)
    if name != "sdpa":
        return name
    register()
    decoder._attn_implementation = ATTENTION_NAME
    return ATTENTION_NAME


def use_kvcompress_attention(model):
    """Switch `model` to the attention function that feeds attention-scored policies (H2O), and hook its attention
    modules to hand probe-scored policies (KVzap) their hidden states (hidden_states.py); returns the model."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return offer_hidden_states(model)
