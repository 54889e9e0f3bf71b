"""plan_layers: each decoder layer's policy, codec, window and RoPE frequencies, and the cache built from them."""

import pytest
import torch

from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.caches.plan import LayerPlan, plan_layers
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.policies.block_window import BlockWindowPolicy
from hf_kvcompress.policies.keep_all import KeepAllPolicy
from hf_kvcompress.policies.sink_window import SinkWindowPolicy
from hf_kvcompress.registry import parse_spec

from .tiny_models import CONFIGS


def plans(spec: str, name: str, **kwargs) -> list[LayerPlan]:
    policy, codec = parse_spec(spec)
    return plan_layers(policy, codec, CONFIGS[name](), **kwargs)


def test_a_full_attention_model_gets_the_policy_and_codec_in_every_layer():
    got = plans("sink_window:sink_tokens=2,window=8+int4", "llama")
    policy, codec = parse_spec("sink_window:sink_tokens=2,window=8+int4")
    assert [p.index for p in got] == [0, 1]
    for p in got:
        assert p.layer_type == "full_attention" and not p.is_sliding
        assert p.policy == policy
        assert p.codec.spec() == codec.spec()
        assert p.window is None and p.attention_window is None
        assert p.inv_freq is None and p.query_inv_freq is None


def test_rerotate_and_query_policies_get_the_full_layers_rope():
    (first, _) = plans("sink_window:sink_tokens=2,window=8", "llama", rerotate=True)
    assert first.inv_freq is not None and first.inv_freq.shape == (32 // 2,)
    (first, _) = plans("expected_attention:budget=8", "llama")
    assert first.inv_freq is None and first.query_inv_freq is not None and first.query_inv_freq.numel() == 16


def test_gemma3_sliding_layers_keep_the_window_and_the_full_layer_the_policy():
    got = plans("sink_window:sink_tokens=2,window=32", "gemma3")  # sliding_window=6: fewer than the budget
    assert [p.layer_type for p in got] == ["sliding_attention", "sliding_attention", "full_attention"]
    for p in got[:2]:
        assert p.is_sliding and p.window == 6 and p.attention_window == 6
        assert p.policy == SinkWindowPolicy(sink_tokens=0, window=5)  # transformers keeps window - 1
        assert p.codec == IdentityCodec()
    assert not got[2].is_sliding and got[2].policy == parse_spec("sink_window:sink_tokens=2,window=32")[0]


def test_gemma3_sliding_layers_drop_whole_key_groups_or_keep_a_share():
    int4 = plans("int4:group_size=4,residual_length=0", "gemma3")
    assert isinstance(int4[0].policy, BlockWindowPolicy) and int4[0].policy.window == 5
    assert isinstance(int4[2].policy, KeepAllPolicy)
    share = plans("dynamic:sliding=3", "gemma3")
    assert share[0].policy == SinkWindowPolicy(sink_tokens=0, window=3)
    assert isinstance(share[2].policy, KeepAllPolicy)


def test_plans_refuse_what_the_cache_refuses():
    with pytest.raises(ValueError, match="has none"):
        plans("dynamic:sliding=3", "llama")
    with pytest.raises(ValueError, match="more than this model's sliding layers hold"):
        plans("dynamic:sliding=9", "gemma3")


SPECS = ["dynamic", "int4", "sink_window:sink_tokens=2,window=8+int4", "kvzip:ratio=0.5", "h2o:budget=8,recent=2+fp8",
         "expected_attention:budget=8"]


@pytest.mark.parametrize("name, spec", [("llama", s) for s in SPECS] + [("gemma3", s) for s in SPECS]
                         + [("gemma3", "dynamic:sliding=3"), ("gemma3", "kvzip:ratio=0.5+int4")])
def test_the_cache_builds_its_layers_from_the_plan(name, spec):
    policy, codec = parse_spec(spec)
    config = CONFIGS[name]()
    cache = CompressedCache(policy, codec, config=config)
    planned = plan_layers(policy, codec, config)
    assert len(cache.layers) == len(planned)
    for layer, plan in zip(cache.layers, planned, strict=True):
        assert layer.policy == plan.policy
        assert layer.codec == plan.codec and layer.codec.spec() == plan.codec.spec()
        assert layer.is_sliding == plan.is_sliding
        assert layer.attention_window == plan.attention_window
        assert (layer.inv_freq is None) == (plan.inv_freq is None)
        want = None if plan.query_inv_freq is None else tuple(plan.query_inv_freq.tolist())
        assert layer.query_inv_freq == want


def test_a_cache_without_config_numbers_its_layers_as_the_plan_does():
    policy, codec = parse_spec("int4")
    config = CONFIGS["llama"]()
    cache = CompressedCache(policy, codec)
    keys = torch.zeros(1, 2, 1, 32)
    for i in range(2):
        cache.update(keys, keys, i)
    assert [layer.codec for layer in cache.layers] == [p.codec for p in plan_layers(policy, codec, config)]


def test_only_a_plain_kvzip_ratio_on_a_hybrid_model_plans_a_sliding_share():
    """A full-attention model, a budget, an explicit sliding= or a policy without KVzip's pass keep the plain share
    (so nothing changes on SmolLM2); a plain kvzip ratio r on Gemma-3's layout planned by its own rule (a byte
    target by default: tests/caches/test_ratio_bytes.py) keeps r of the sliding layers' share."""
    unplanned = [("kvzip:ratio=0.25", "llama"), ("kvzip:budget=4", "gemma3"), ("kvzip:ratio=0.5,sliding=2", "gemma3"),
                 ("h2o:ratio=0.5", "gemma3"), ("dynamic", "gemma3"), ("kvzip:ratio=0.25", "gemma3")]
    for spec, name in unplanned:
        assert all(p.sliding_share is None for p in plans(spec, name)), spec
    # sliding_window=6: ceil(0.5 x 0.5 x 5) = 2 of the share's 3
    got = plans("kvzip:ratio=0.5", "gemma3", ratio_bytes=False)
    assert [p.policy for p in got[:2]] == [SinkWindowPolicy(sink_tokens=0, window=2)] * 2
    share = got[2].sliding_share
    assert share is not None and (share.kept, share.held, share.sliding_layers, share.full_layers) == (2, 5, 2, 1)
    seen = torch.tensor([3, 20, 40])
    full = torch.ceil(seen * 0.5).long()
    # what the sliding layers gave up: ceil(0.5 x min(seen, 5)) - min(seen, 2) tokens each, two of them
    assert share.extra(seen, full).tolist() == [0, 2, 2]


@pytest.mark.parametrize("ratio,kept", [(0.5, 192), (0.6, 276), (0.35, 44), (0.25, 16), (0.125, 16), (0.05, 16),
                                        (0.9, 460)])
def test_a_planned_sliding_layer_keeps_r_of_its_share_above_a_32nd_of_its_window(ratio, kept):
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=1,
        num_key_value_heads=1, head_dim=32, sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    policy, codec = parse_spec(f"kvzip:ratio={ratio}")
    got = plan_layers(policy, codec, config, ratio_bytes=False)  # the ratio's own plan (a byte target by default)
    # 1.5 x r x r of the 511 tokens from a half up (0.5: 191.6, where 128 lost Gemma-3's first tenth of multi_needle
    # and 256 its last; 0.6: 275.9), at most the ratio's own share (0.9: 459.9), 2 x r x r x r below (0.35: 43.8), at
    # least 511 / 32 (16)
    assert {p.policy for p in got[:5]} == {SinkWindowPolicy(sink_tokens=0, window=kept)}
    assert got[5].sliding_share is not None and got[5].sliding_share.kept == kept
