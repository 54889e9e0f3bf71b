"""JoinedHeads (caches/joined_heads.py): each head's pairs and tail back to back with room, on plain tensors."""

import pytest
import torch

from hf_kvcompress.caches.joined_heads import JoinedHeads


@pytest.mark.parametrize("tail_tokens", [0, 3])
def test_views_appends_and_unjoin_give_each_heads_pairs_then_its_tail(tail_tokens):
    g = torch.Generator().manual_seed(0)
    rows, heads, dim, capacity = 2, 3, 4, 6
    counts = [5, 0, 2, 7, 1, 3]  # (row, head) order; a head may hold no pair
    flat = [torch.randn(sum(counts), dim, generator=g) for _ in range(2)]
    pairs = tuple(tuple(t.split(counts)) for t in flat)
    tail = None
    if tail_tokens:
        tail = tuple(torch.randn(rows, heads, tail_tokens, dim, generator=g) for _ in range(2))
    joined = JoinedHeads(pairs, tail, capacity, rows)
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
