"""Expected Attention on pure tensors: its score against a plain computation, what it estimates, its parameters."""

import math

import pytest
import torch

from hf_kvcompress.policies.base import RecentQueries, select_kept
from hf_kvcompress.policies.expected_attention import ExpectedAttentionPolicy
from hf_kvcompress.registry import parse_spec

from .expected_attention_reference import reference_scores


def _case(seed, batch=2, kv_heads=2, groups=2, slots=9, window=7, dim=8, rotary_half=4):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=g)
    values = torch.randn(batch, kv_heads, slots, dim, generator=g)
    queries = torch.randn(batch, kv_heads * groups, window, dim, generator=g) * 0.7 + 0.3
    counted = torch.ones(batch, window, dtype=torch.bool)
    counted[0, :3] = False  # row 0: its oldest entries are padding (or sink queries)
    queries[0, :, :3] = 1e4  # ... holding values that would swamp the statistics if they counted
    pads = torch.tensor([2, 0][:batch])
    keys[0, :, :2] = 50.0  # padding keys that would take the whole softmax if they counted
    inv_freq = 1.0 / (100.0 ** (torch.arange(rotary_half, dtype=torch.float32) / rotary_half))
    next_position = torch.tensor([11, 30][:batch])
    return keys, values, RecentQueries(queries, counted, next_position, inv_freq), pads


@pytest.mark.parametrize("covariance,value_norm,epsilon,rotary_half,future,sink_tokens",
                         [(True, True, 0.0, 4, 5, 4), (False, True, 0.0, 4, 3, 4), (True, False, 0.0, 4, 1, 2),
                          (True, True, 0.01, 2, 4, 4), (True, True, 0.0, 0, 4, 4), (True, True, 0.01, 4, 5, 0)])
def test_score_matches_the_plain_computation(covariance, value_norm, epsilon, rotary_half, future, sink_tokens):
    # Covers GQA (two query heads per KV head), padding keys and queries, sink keys left out of the normalisation
    # (or none), partial rotary (rotary_half=2 of 4) and a model without RoPE (rotary_half=0).
    keys, values, queries, pads = _case(0, rotary_half=rotary_half)
    policy = ExpectedAttentionPolicy(ratio=0.5, future=future, covariance=covariance, value_norm=value_norm,
                                     epsilon=epsilon, sink_tokens=sink_tokens)
    got = policy.score(None, keys.shape[2], keys=keys, pads=pads, values=values, queries=queries)
    expected = reference_scores(keys, values, queries.queries, queries.counted, queries.next_position,
                                queries.inv_freq, pads, future, covariance, value_norm, epsilon, policy.sink_tokens)
    for b in range(keys.shape[0]):
        real = slice(int(pads[b]), None)
        torch.testing.assert_close(got[b, :, real].double(), expected[b, :, real], rtol=1e-4, atol=1e-6)


def test_score_is_the_expected_attention_of_the_modelled_queries():
    # With many Gaussian queries and one position ahead, the closed form matches the average over those queries
    # (rotated to that position) of their normalised attention's numerator exp(q.k), normalised over the keys.
    g = torch.Generator().manual_seed(1)
    dim, slots, n = 4, 6, 200_000
    mixing = torch.randn(dim, dim, generator=g) * 0.3
    pre_rope = (torch.randn(n, dim, generator=g) @ mixing + torch.tensor([0.5, -0.2, 0.1, 0.3]))[None, None]
    keys = torch.randn(1, 1, slots, dim, generator=g)
    inv_freq = torch.tensor([1.0, 0.1])
    queries = RecentQueries(pre_rope, torch.ones(1, n, dtype=torch.bool), torch.tensor([7]), inv_freq)
    policy = ExpectedAttentionPolicy(ratio=0.5, future=1, value_norm=False, sink_tokens=0)
    got = policy.score(None, slots, keys=keys, pads=torch.tensor([0]), queries=queries)[0, 0]
    angle = 7 * inv_freq
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
    q = pre_rope[0, 0]
    rotated = q * cos + torch.cat([-q[:, 2:], q[:, :2]], dim=-1) * sin
    empirical = torch.exp(rotated @ keys[0, 0].T).mean(0)
    torch.testing.assert_close(got, empirical / empirical.sum(), rtol=0.02, atol=0)


def test_the_sinks_take_no_share_of_the_normalisation():
    # As ExpectedAttentionPress scores the keys after its sinks: a row's expectations sum to 1 past its sinks,
    # whatever its sink keys (here large enough to take the whole softmax if they counted), and equal the scores of
    # the same keys without the sinks.
    keys, values, queries, pads = _case(5, batch=1)
    keys[:, :, :3] = 40.0
    policy = ExpectedAttentionPolicy(ratio=0.5, value_norm=False, sink_tokens=3)
    got = policy.score(None, keys.shape[2], keys=keys, pads=pads[:1] * 0, values=values, queries=queries)
    torch.testing.assert_close(got[..., 3:].sum(-1), torch.ones(1, 2))
    assert (got[..., :3] == 0).all()
    alone = ExpectedAttentionPolicy(ratio=0.5, value_norm=False, sink_tokens=0).score(
        None, keys.shape[2] - 3, keys=keys[:, :, 3:], pads=pads[:1] * 0, values=values[:, :, 3:], queries=queries)
    torch.testing.assert_close(got[..., 3:], alone)


def test_padding_is_never_kept_over_a_real_slot():
    keys, values, queries, pads = _case(3)
    policy = ExpectedAttentionPolicy(budget=5, sink_tokens=1, recent=1)
    scores = policy.score(None, keys.shape[2], keys=keys, pads=pads, values=values, queries=queries)
    kept = select_kept(policy, scores, pads, heads=2, length=keys.shape[2])
    assert (kept[0] >= 2).all() and kept.shape == (2, 2, 5)


@pytest.mark.parametrize("kwargs,name", [
    ({"window": 0}, "window"), ({"window": 2.5}, "window"), ({"future": 0}, "future"),
    ({"covariance": "yes"}, "covariance"), ({"value_norm": 1}, "value_norm"), ({"epsilon": -0.1}, "epsilon"),
    ({"epsilon": math.nan}, "epsilon"), ({"epsilon": True}, "epsilon"), ({"recent": -1}, "recent"),
    ({"sink_tokens": -2}, "sink_tokens"), ({"budget": 3, "sink_tokens": 4}, "budget"),
    ({"ratio": 1.5}, "ratio"), ({"budget": 64, "ratio": 0.5}, "either budget"), ({"decoding": "keep"}, "decoding"),
    ({"window": -1, "decoding": "evict"}, "window"),
])
def test_bad_parameters_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ExpectedAttentionPolicy(**kwargs)


def test_spec_strings_build_and_rebuild_the_policy():
    policy, _ = parse_spec("expected_attention:ratio=0.5,window=16,future=64,covariance=false,epsilon=0.01")
    assert (policy.window, policy.future, policy.covariance, policy.epsilon) == (16, 64, False, 0.01)
    assert parse_spec(policy.spec())[0] == policy
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        parse_spec("expected_attention:window=0")
    with pytest.raises(ValueError, match="unknown policy argument"):
        parse_spec("expected_attention:n_future_positions=8")


def test_the_queries_are_held_between_steps_only_to_evict_while_decoding():
    # By default each step is scored by its own queries (all of them: window None) and a decode step appends;
    # decoding=evict holds the newest `window` (64 unless given) for the decode steps it scores.
    plain = ExpectedAttentionPolicy(ratio=0.5)
    assert (plain.observed_queries, plain.evicts_while_decoding) == (None, False)
    assert ExpectedAttentionPolicy(ratio=0.5, window=16).observed_queries == 16
    held = parse_spec("expected_attention:ratio=0.5,decoding=evict")[0]
    assert (held.observed_queries, held.evicts_while_decoding) == (64, True)
    assert parse_spec(held.spec())[0] == held
    with pytest.raises(ValueError, match="decoding must be one of append, evict"):
        parse_spec("expected_attention:ratio=0.5,decoding=drop")
