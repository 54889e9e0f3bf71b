"""JoinedHeads (caches/joined_heads.py): each head's pairs and tail back to back with room, on plain tensors."""

import pytest
import torch

from hf_kvcompress.caches.joined_heads import JoinedHeads, group_heads

from .tiny_models import attend_per_head


@pytest.mark.parametrize("slack", [None, 0])  # 0: every head in one group, each after a gap to the widest
@pytest.mark.parametrize("tail_tokens", [0, 3])
def test_views_appends_and_unjoin_give_each_heads_pairs_then_its_tail(tail_tokens, slack):
    g = torch.Generator().manual_seed(0)
    rows, heads, dim, capacity = 2, 3, 4, 6
    counts = [5, 0, 2, 7, 1, 3]  # (row, head) order; a head may hold no pair
    flat = [torch.randn(sum(counts), dim, generator=g) for _ in range(2)]
    pairs = tuple(tuple(t.split(counts)) for t in flat)
    tail = None
    if tail_tokens:
        tail = tuple(torch.randn(rows, heads, tail_tokens, dim, generator=g) for _ in range(2))
    joined = JoinedHeads(pairs, tail, capacity, rows, slack=slack)
    new = [torch.randn(rows, heads, 1, dim, generator=g) for _ in range(capacity - tail_tokens)]
    buffers = [b.data_ptr() for b in joined.buffers]
    for step in new:
        assert joined.has_room
        joined.append(step, -step)
    assert not joined.has_room and [b.data_ptr() for b in joined.buffers] == buffers  # written in place
    for kind in (0, 1):
        sign = 1 if kind == 0 else -1
        recent = torch.cat([sign * s for s in new], 2)
        if tail is not None:
            recent = torch.cat([tail[kind], recent], 2)
        recent = recent.flatten(0, 1)
        expected = [torch.cat([p, recent[i]]) for i, p in enumerate(pairs[kind])]
        got = joined.views(kind)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        flat_pairs, tail_back = joined.unjoin(kind)
        assert torch.equal(flat_pairs, flat[kind])
        assert tail_back is not None and torch.equal(tail_back, recent.view(rows, heads, capacity, dim))


def test_a_join_without_a_tail_unjoins_to_no_tail():
    pairs = tuple((torch.ones(2, 4), torch.zeros(0, 4)) for _ in range(2))
    joined = JoinedHeads(pairs, None, 4, 1)
    assert joined.tail == 0 and [v.shape[0] for v in joined.views(0)] == [2, 0]
    flat, tail = joined.unjoin(1)
    assert torch.equal(flat, torch.ones(2, 4)) and tail is None


def test_heads_group_while_the_widest_holds_at_most_a_slot_over_slack_more():
    # slot: the widest's pairs + capacity; 10 - 9 = 1 <= (10 + 22) / 32, 10 - 0 and 100 - 10 are not
    assert group_heads([10, 0, 10, 9, 100], capacity=22, slack=32) == [[0, 2, 3], [1], [4]]
    assert group_heads([10, 0, 10, 9, 100], capacity=22, slack=0) == [[0, 1, 2, 3, 4]]  # every head in one group
    assert group_heads([3, 1, 2], capacity=4, slack=1e9) == [[0], [1], [2]]  # alone: the heads' own order
    assert group_heads([2, 5, 2], capacity=4, slack=float("inf")) == [[0, 2], [1]]  # equal heads share a call
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 300, (48,), generator=g).tolist()
    groups = group_heads(counts, capacity=40, slack=8)
    assert sorted(h for group in groups for h in group) == list(range(48))
    for group in groups:
        widest = max(counts[h] for h in group)
        assert all((widest - counts[h]) * 8 <= widest + 40 for h in group)


@pytest.mark.parametrize("slack", [None, 0, 8, 1e9])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_grouped_attention_equals_one_call_per_head_and_its_bytes_are_counted(slack, dtype, tolerance):
    g = torch.Generator().manual_seed(2)
    rows, heads, dim, capacity, tail_tokens = 3, 4, 8, 5, 2
    counts = [30, 0, 29, 7, 30, 31, 1, 0, 8, 60, 30, 2]  # equal, close and far apart; some heads hold no pair
    flat = [torch.randn(sum(counts), dim, generator=g).to(dtype) for _ in range(2)]
    pairs = tuple(tuple(t.split(counts)) for t in flat)
    tail = tuple(torch.randn(rows, heads, tail_tokens, dim, generator=g).to(dtype) for _ in range(2))
    joined = JoinedHeads(pairs, tail, capacity, rows, slack=slack)
    if slack == 0:
        assert len(joined.groups) == 1 and joined.gaps == sum(60 - c for c in counts)
    for _ in range(capacity - tail_tokens):
        query = torch.randn(rows * heads, 1, 3, dim, generator=g).to(dtype)
        torch.testing.assert_close(joined.attend(query, 0.3), attend_per_head(joined, query, 0.3),
                                   rtol=tolerance, atol=tolerance)
        step = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
        joined.append(step, -step)
    for kind in (0, 1):  # the gaps hold zeros and move nothing: the pairs come back as they went in
        assert torch.equal(joined.unjoin(kind)[0], flat[kind])
        rows_held = sum(counts) + joined.gaps + len(counts) * capacity
        assert joined.buffers[kind].numel() == rows_held * dim
    masks = sum(m.numel() for m in joined.masks if m is not None)
    order = 0 if joined.order is None else 16 * len(counts)
    width = 2 * dim * flat[0].element_size()
    assert joined.layout_bytes(width) == joined.gaps * width + 8 * len(counts) + masks + order
