"""Policies on pure tensors: what is kept, padding handling, and parameter checks."""

import pytest
import torch

from hf_kvcompress.policies.base import select_kept
from hf_kvcompress.policies.heavy_hitter import HeavyHitterPolicy
from hf_kvcompress.policies.kvzip import KVzipPolicy
from hf_kvcompress.policies.sink_window import SinkWindowPolicy
from hf_kvcompress.policies.snapkv import SnapKVPolicy
from hf_kvcompress.policies.tova import TOVAPolicy


def test_sink_window_keeps_sinks_and_recent():
    policy = SinkWindowPolicy(sink_tokens=2, window=4)
    kept = select_kept(policy, None, torch.tensor([0]), heads=1, length=10)
    assert kept.tolist() == [[[0, 1, 6, 7, 8, 9]]]


def test_lesson_practice_sinks_three():
    # The lesson's practice: sinks=3 protects "A17" and pays with the oldest recent token.
    tokens = ["<s>", "Order", "A17", "is", "late", "and", "the", "box", "was", "wet"]
    kept = select_kept(SinkWindowPolicy(sink_tokens=3, window=3), None, torch.tensor([0]), heads=1, length=10)
    assert [tokens[i] for i in kept[0, 0]] == ["<s>", "Order", "A17", "box", "was", "wet"]


def test_padding_is_evicted_first_and_never_a_sink():
    policy = SinkWindowPolicy(sink_tokens=2, window=3)
    # Row 0 has 3 padding slots, row 1 none: sinks of row 0 are its first real tokens (slots 3 and 4).
    kept = select_kept(policy, None, torch.tensor([3, 0]), heads=1, length=10)
    assert kept[0, 0].tolist() == [3, 4, 7, 8, 9]
    assert kept[1, 0].tolist() == [0, 1, 7, 8, 9]


def test_short_padded_row_keeps_padding_at_the_front():
    # Only 3 real tokens for a budget of 5: two padding slots survive, first, so the padding mask still lines up.
    kept = select_kept(SinkWindowPolicy(sink_tokens=1, window=4), None, torch.tensor([7]), heads=1, length=10)
    assert kept[0, 0].tolist()[-3:] == [7, 8, 9]
    assert all(i < 7 for i in kept[0, 0].tolist()[:2])


def test_heavy_hitters_are_kept_per_head():
    policy = HeavyHitterPolicy(budget=3, recent=1)
    scores = torch.tensor([[[5.0, 0.0, 1.0, 0.0, 0.0, 9.0], [0.0, 7.0, 0.0, 6.0, 0.0, 0.0]]])
    kept = select_kept(policy, scores, torch.tensor([0]), heads=2, length=6)
    assert kept[0, 0].tolist() == [0, 2, 5]
    assert kept[0, 1].tolist() == [1, 3, 5]


@pytest.mark.parametrize(
    "factory,name",
    [
        (lambda: SinkWindowPolicy(window=0), "window"),
        (lambda: SinkWindowPolicy(sink_tokens=-1), "sink_tokens"),
        (lambda: HeavyHitterPolicy(budget=10, recent=16), "budget"),
        (lambda: HeavyHitterPolicy(budget=0, recent=0), "budget"),
        (lambda: HeavyHitterPolicy(recent=-1), "recent"),
        (lambda: KVzipPolicy(span=-1), "span"),
        (lambda: KVzipPolicy(span=1.5), "span"),
        (lambda: TOVAPolicy(heads="all"), "heads must be one of mean, each"),
        (lambda: SnapKVPolicy(decoding="keep"), "decoding must be one of append, evict, got 'keep'"),
        (lambda: SnapKVPolicy(pooling="mean"), "pooling must be one of avg, max, got 'mean'"),
        (lambda: SnapKVPolicy(budget=40), "budget must be a positive integer >= recent"),
    ],
)
def test_bad_parameters_name_themselves(factory, name):
    with pytest.raises(ValueError, match=name):
        factory()


def test_kvzip_span_gives_each_pair_the_best_score_of_itself_and_the_pairs_after_it():
    scores = torch.rand(2, 3, 11, generator=torch.Generator().manual_seed(0))
    for span in (0, 1, 3, 20):
        expected = torch.stack([scores[..., t : t + span + 1].amax(-1) for t in range(11)], dim=-1)
        assert torch.equal(KVzipPolicy(span=span).score(scores, 11), expected)
    assert KVzipPolicy(span=0).score(scores, 11) is scores


# -- ratio: a share of the tokens seen instead of a fixed budget ----------------------------------------------------


def test_ratio_keeps_a_share_of_each_rows_real_tokens_and_fills_with_padding():
    from hf_kvcompress.policies.tova import TOVAPolicy

    policy = TOVAPolicy(ratio=0.5)
    # Row 0: 4 padding + 6 real tokens -> keeps 3 real; row 1: 10 real -> keeps 5. K = 5 slots per row.
    real_seen = torch.tensor([6, 10])
    keep = policy.kept_per_row(real_seen)
    assert keep.tolist() == [3, 5]
    scores = torch.arange(10, dtype=torch.float32).flip(0)[None, None, :].expand(2, 1, 10)  # older scores higher
    kept = select_kept(policy, scores, torch.tensor([4, 0]), heads=1, length=10, keep=keep)
    assert kept[1, 0].tolist() == [0, 1, 2, 3, 4]
    assert kept[0, 0].tolist()[2:] == [4, 5, 6] and all(i < 4 for i in kept[0, 0].tolist()[:2])


def test_ratio_never_keeps_fewer_than_sinks_and_recent():
    policy = HeavyHitterPolicy(ratio=0.1, recent=4, sink_tokens=1)
    assert policy.kept_per_row(torch.tensor([20, 3, 200])).tolist() == [5, 3, 20]


@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova", "keydiff", "random", "kvzip", "expected_attention"])
def test_budget_and_ratio_exclude_each_other_by_spec(name):
    from hf_kvcompress.registry import parse_spec

    with pytest.raises(ValueError, match="either budget"):
        parse_spec(f"{name}:budget=64,ratio=0.5")
    for bad in ("0", "1.5", "-0.2", "nan"):
        with pytest.raises(ValueError, match="ratio must be a number in"):
            parse_spec(f"{name}:ratio={bad}")
    policy, _ = parse_spec(f"{name}:ratio=0.25")
    assert policy.ratio == 0.25 and policy.budget is None and policy.spec() == f"{name}:ratio=0.25"
    assert parse_spec(name)[0].budget == 512 and parse_spec(name)[0].spec() == name


def test_sink_window_by_ratio_keeps_sinks_and_the_newest():
    policy = SinkWindowPolicy(sink_tokens=2, ratio=0.5)
    assert policy.budget is None and policy.spec() == "sink_window:sink_tokens=2,ratio=0.5"
    keep = policy.kept_per_row(torch.tensor([10]))
    kept = select_kept(policy, None, torch.tensor([0]), heads=1, length=10, keep=keep)
    assert kept.tolist() == [[[0, 1, 7, 8, 9]]]
    with pytest.raises(ValueError, match="either window"):
        SinkWindowPolicy(window=8, ratio=0.5)


def test_spec_strings_need_no_registry_and_name_what_the_registry_builds():
    """Policies and codecs write their own spec strings (no import of the registry, which imports them); each name
    is the registry's, so every spec string parses back to an equal object."""
    import ast
    from pathlib import Path

    from hf_kvcompress.registry import CODECS, POLICIES, cache_spec, parse_spec

    package = Path(__file__).resolve().parents[2] / "hf_kvcompress"
    for folder in ("policies", "codecs"):
        for source in (package / folder).glob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.ImportFrom):
                    assert "registry" not in (node.module or ""), f"{source.name} imports the registry"
    for name, cls in POLICIES.items():
        assert cls.name == name
    for spec in ("h2o:budget=300,sink_tokens=4", "snapkv:ratio=0.25", "sink_window:window=64", "kvzip:ratio=0.5",
                 "dynamic", "fp8", "int4", "int2:rotate=none,sink_tokens=0", "int8:group_size=16",
                 "shared_heads+int8", "lowrank:rank=32+int4", "kvzip:ratio=0.25+int4",
                 "expected_attention:ratio=0.5,window=32+int4"):
        policy, codec = parse_spec(spec)
        rebuilt = parse_spec(cache_spec(policy, codec))
        assert rebuilt == (policy, codec), (spec, cache_spec(policy, codec))
    assert {n for n, f in CODECS.items() if not n.startswith("int")} == {
        f.name for n, f in CODECS.items() if not n.startswith("int")
    }
