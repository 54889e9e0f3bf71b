"""The decode-step eviction (`drop_one`: one argmin) keeps what the general `select_kept` (a sort) keeps."""

from types import SimpleNamespace

import pytest
import torch

from hf_kvcompress.policies.base import drop_one, recency_drop, select_kept, slot_priority
from hf_kvcompress.policies.heavy_hitter import HeavyHitterPolicy
from hf_kvcompress.policies.sink_window import SinkWindowPolicy

POLICIES = [
    SinkWindowPolicy(sink_tokens=2, window=10), SinkWindowPolicy(sink_tokens=0, window=12),
    HeavyHitterPolicy(budget=12, recent=3, sink_tokens=2), HeavyHitterPolicy(budget=12, recent=0),
]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize("seed", range(5))
def test_drop_one_keeps_what_select_kept_keeps(policy, seed):
    g = torch.Generator().manual_seed(seed)
    batch, heads, length = 4, 3, policy.budget + 1
    pads = torch.tensor([0, 1, 3, 0])
    # Integer scores make ties, which both must break alike (the newest of the lowest goes).
    if isinstance(policy, SinkWindowPolicy):
        scores = None
    else:
        scores = torch.randint(0, 4, (batch, heads, length), generator=g).float()
    reference = select_kept(policy, scores, pads, heads, length)
    fast = drop_one(policy, scores, pads, heads, length)
    assert fast.shape == reference.shape == (batch, heads, policy.budget)
    assert (fast.diff(dim=-1) > 0).all()
    def real(kept):
        return [[sorted(s for s in kept[b, h].tolist() if s >= pads[b]) for h in range(heads)] for b in range(batch)]

    assert real(fast) == real(reference)  # the same real slots; padding is masked whichever padding slot stays


@pytest.mark.parametrize("sinks,recent", [(0, 0), (2, 3), (4, 9), (6, 8)])
def test_the_recency_drop_is_the_argmin_of_the_slot_priority(sinks, recent):
    # Without scores the dropped slot follows from each row's padding; here against the priority it replaces, also
    # where every real slot is protected (sinks + recent cover the row).
    policy = SimpleNamespace(sink_tokens=sinks, recent=recent)  # all that either reads of a policy
    length, heads = 14, 2
    pads = torch.arange(0, length + 1)
    priority = slot_priority(policy, None, pads, heads, length)
    expected = (length - 1) - priority.flip(-1).argmin(-1)  # [B, H]
    assert torch.equal(recency_drop(policy, pads, length)[:, None].expand(-1, heads), expected)


@pytest.mark.parametrize("seed", range(5))
def test_drop_one_keeps_what_select_kept_keeps_for_a_ratio_when_every_row_keeps_as_many(seed):
    # A ratio's decode step takes drop_one when every row keeps the same count behind no padding (eviction.py).
    g = torch.Generator().manual_seed(seed)
    policy = HeavyHitterPolicy(ratio=0.5, recent=2, sink_tokens=1)
    batch, heads, length = 3, 2, 17
    pads = torch.zeros(batch, dtype=torch.long)
    scores = torch.randint(0, 4, (batch, heads, length), generator=g).float()
    keep = torch.full((batch,), length - 1)
    reference = select_kept(policy, scores, pads, heads, length, keep, length - 1)
    assert torch.equal(drop_one(policy, scores, pads, heads, length), reference)
