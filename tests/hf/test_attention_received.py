"""The attention statistics (`attention_received`) against a plain softmax over the whole [q, kv] matrix.

The function groups query heads per KV head and leaves out the keys after a causal query block's last slot; these
tests run it with blocks of 4 queries, so several blocks, the diagonal ones and the fallback for masks that let a
query see ahead are all exercised.
"""

import pytest
import torch

from hf_kvcompress.hf import attention
from hf_kvcompress.hf.attention import attention_received

KV_HEADS, GROUPS, DIM = 2, 3, 8


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)


def _reference(query, key, allowed, scaling, softcap=None, newest=None, reduction="sum", query_mask=None):
    """softmax(QK^T) over every key with the keys repeated per query head, then reduced per KV head."""
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = query @ keys.transpose(-1, -2) * scaling  # [B, H_q, q, kv]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    if query_mask is not None:
        probs = probs * query_mask[:, None, :, None]
    if newest is not None:
        probs = probs[:, :, -newest:]
    batch, heads, q, kv = probs.shape
    grouped = probs.view(batch, key.shape[1], heads // key.shape[1], q, kv)
    return grouped.sum(dim=(2, 3)) if reduction == "sum" else grouped.amax(dim=(2, 3))


def _inputs(batch, q, kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, KV_HEADS * GROUPS, q, DIM, generator=g)
    key = torch.randn(batch, KV_HEADS, kv, DIM, generator=g)
    return query, key


def _causal(batch, q, kv, pads=None):
    """[B, 1, q, kv] bool: query i sits at slot kv - q + i; a row's first pads[b] slots are padding."""
    allowed = torch.arange(kv)[None, :] <= torch.arange(q)[:, None] + (kv - q)
    allowed = allowed.expand(batch, 1, q, kv).clone()
    if pads is not None:
        allowed &= torch.arange(kv)[None, None, None, :] >= torch.tensor(pads)[:, None, None, None]
    return allowed


@pytest.mark.parametrize("q,kv", [(1, 9), (1, 13), (11, 11), (11, 15), (4, 10), (9, 9)])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_statistics_equal_a_plain_softmax(q, kv, mask, reduction):
    query, key = _inputs(2, q, kv)
    allowed = _causal(2, q, kv, pads=[0, 2])
    if mask == "none":
        allowed, given = _causal(2, q, kv), None
    elif mask == "bool":
        given = allowed
    else:  # additive, as transformers builds float masks: 0 or the dtype's minimum
        given = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    got = attention_received(query, key, given, 0.3, reduction=reduction)
    torch.testing.assert_close(got, _reference(query, key, allowed, 0.3, reduction=reduction), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("newest", [None, 3, 6])
def test_softcap_newest_queries_and_query_mask(newest):
    query, key = _inputs(2, 10, 14, seed=3)
    allowed = _causal(2, 10, 14, pads=[1, 0])
    query_mask = torch.ones(2, 10)
    query_mask[0, 7] = 0
    got = attention_received(query, key, allowed, 0.4, softcap=2.0, newest_queries=newest,
                             query_mask=query_mask.bool())  # fmt: skip
    expected = _reference(query, key, allowed, 0.4, softcap=2.0, newest=newest, query_mask=query_mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_a_mask_that_sees_ahead_reads_every_key(dtype):
    """A prefix mask (the first 6 new tokens see each other, as bidirectional image tokens do): the first block's
    queries attend to keys after their own slots, so no key may be left out of the product."""
    q, kv = 11, 13
    query, key = _inputs(1, q, kv, seed=5)
    allowed = _causal(1, q, kv)
    allowed[..., :6, : kv - q + 6] = True
    given = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    assert not attention._future_hidden(given, kv - q, q)
    got = attention_received(query, key, given, 0.3)
    torch.testing.assert_close(got, _reference(query, key, allowed, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q,kv", [(1, 12), (11, 11), (9, 14)])
def test_padded_row_equals_the_row_alone(q, kv):
    """A left-padded row's statistics over its real keys equal the row's alone; its padding keys get none."""
    query, key = _inputs(2, q, kv, seed=7)
    pads = 3 if q == kv else 2
    batch = attention_received(query, key, _causal(2, q, kv, pads=[0, pads]), 0.3)
    real_q = q - pads if q == kv else q  # a prompt step: the row's first queries are its padding
    alone = attention_received(query[1:, :, q - real_q :], key[1:, :, pads:], None, 0.3)
    torch.testing.assert_close(batch[1:, :, pads:], alone, rtol=1e-5, atol=1e-6)
    assert (batch[1, :, :pads] == 0).all()
