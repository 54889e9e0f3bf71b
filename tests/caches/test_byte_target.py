"""KVzip's `bytes=B`: the cache holds B of the uncompressed cache's bytes (codec included), on a full-attention and a
hybrid (sliding-window) tiny model, and bad input is refused naming the parameter."""

import warnings

import pytest
import torch

from hf_kvcompress import make_cache, prefill, study
from hf_kvcompress.caches.plan import for_model, plan_layers
from hf_kvcompress.measure import served_kv_bytes
from hf_kvcompress.policies.sink_window import SinkWindowPolicy
from hf_kvcompress.registry import parse_spec

from .tiny_models import CONFIGS, HYBRID, tiny_hybrid_gemma

REPEAT = [5, 6, 7]


def _served(model, spec, ids):
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    return served_kv_bytes(cache, torch.bfloat16), cache


@pytest.mark.parametrize("layer_types", [HYBRID, ["full_attention"] * 2], ids=["hybrid", "full"])
@pytest.mark.parametrize("spec,share", [("kvzip:bytes=0.25", 0.25), ("kvzip:bytes=0.5", 0.5),
                                        ("kvzip:bytes=0.1+int4", 0.1), ("kvzip:bytes=0.2+int8", 0.2)])
def test_the_cache_holds_the_share_of_the_uncompressed_bytes(layer_types, spec, share):
    model = tiny_hybrid_gemma(layer_types)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    reference, _ = _served(model, "dynamic", ids)  # the eval's uncompressed cache (a sliding layer: its window)
    held, cache = _served(model, spec, ids)
    head, _, codec = spec.partition("+")  # the spec names the span the layout chose: 4 with sliding layers, else 0
    hybrid = "sliding_attention" in layer_types  # and a plain bytes= the codec the plan chose (plan.py)
    plan = f"int4:residual_length={8 if hybrid else 32}"  # plan.py `byte_plan_codec`
    assert cache.spec == f"{head},span={4 if hybrid else 0}+{codec or plan}"
    # Never above (span re-chooses pairs within a head's residual and encoded slots separately, so the pairs cost
    # what the ranking paid), and below by little: the pair that did not fit, the sliding layers' rounding; less
    # where every pair fits (a half in int4 on the full-attention model: 0.41 of the bytes).
    full = 400 * sum(t == "full_attention" for t in layer_types)  # pairs of the full-attention layers (1 KV head)
    kept = sum(layer.store.held_pairs().sum() for layer in cache.layers if layer.per_head)
    assert (0.93 * share if kept < full else 0) <= held / reference <= share, held / reference
    # The byte count and the ratio it stands for differ where the codec compresses: int4 keeps more pairs (on the
    # full-attention model; the hybrid one's sliding windows take their own share, tested below).
    if "int8" not in spec and not hybrid:
        assert kept > share * full


def test_span_zero_spends_the_bytes_to_a_pair():
    """Without span re-choosing pairs, the ranking buys pairs exactly up to the target (less under one pair)."""
    model = tiny_hybrid_gemma(["full_attention"] * 2)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    held, cache = _served(model, "kvzip:bytes=0.1,span=0+int4", ids)
    target = cache.byte_target.uncompressed(torch.tensor([400])) * 0.1
    pair = 2 * 32 * 2 + 4  # the dearest pair: full precision with its score
    assert target - pair - 64 <= held <= target + 64  # 64: the layers' small bookkeeping


@pytest.mark.parametrize("spec,kept,full_residual", [
    ("kvzip:bytes=0.25", 40, 8), ("kvzip:bytes=0.1", 7, 8), ("kvzip:bytes=0.05", 2, 8),
    ("kvzip:bytes=0.25+int4", 40, 128), ("kvzip:bytes=0.4", None, 8), ("kvzip:bytes=0.25,sliding=20", 20, 8)])
def test_a_hybrid_model_keeps_a_wide_sliding_window_in_int4(spec, kept, full_residual):
    """The sliding layers keep ceil(10 x B x B x 63) of their 63 tokens (0.25: 39.4; 0.1: 6.3; 0.05: 1.6, and at
    least 63 / 32; the whole window from about 0.32 up; `sliding=` sets it) in int4 with an 8-token exact residual,
    where a ratio of B keeps fewer (16 of Gemma-3's 511 at a quarter);
    a plain bytes= stores the full-attention layers so too, and a codec given keeps its own there."""
    model = tiny_hybrid_gemma(HYBRID)
    cache = make_cache(spec, model.config)
    ratio = make_cache(spec.replace("bytes", "ratio").partition("+")[0], model.config)
    for layer, by_ratio in zip(cache.layers[:2], ratio.layers[:2], strict=True):
        assert (layer.codec.bits, layer.codec.residual_length) == (4, 8)
        assert layer.policy == (SinkWindowPolicy(sink_tokens=0, window=kept) if kept else layer.policy)
        assert kept is None or by_ratio.policy.window <= kept or "sliding=" in spec
    if kept is None:  # the whole window: transformers' window - 1, in int4's key groups
        assert cache.layers[0].policy.window == 63 and cache.planned_sliding is None
    full = cache.layers[2].codec
    assert (full.bits, full.residual_length) == (4, full_residual)


def test_a_model_without_sliding_layers_stores_a_plain_byte_target_in_the_plans_int4():
    """SmolLM2's layout (Llama, full attention only): a plain bytes= stores every layer in `int4:residual_length=32`
    (plan.py `byte_codecs`), a codec given is the codec of every layer, and the policy is the one asked for in every
    layer."""
    config = CONFIGS["llama"]()
    for spec, stored in (("kvzip:bytes=0.25", "int4:residual_length=32"), ("kvzip:bytes=0.25+int4", "int4")):
        policy, codec = parse_spec(spec)
        for plan in plan_layers(policy, codec, config):
            assert plan.codec.spec() == stored and plan.policy == for_model(policy, config)
            assert plan.byte_target is not None and plan.sliding_share is None
        assert make_cache(spec, config).spec == f"{spec.partition('+')[0]},span=0+{stored}"


@pytest.mark.parametrize("tokens", [40, 200, 400])
@pytest.mark.parametrize("spec", ["kvzip:bytes=0.1", "kvzip:bytes=0.25", "kvzip:bytes=0.6", "kvzip:bytes=0.25+int8"])
def test_the_bytes_held_are_the_promised_bytes_at_any_length(spec, tokens):
    """`study.promised_bytes` is what the cache holds: B of the uncompressed bytes (counted here by hand, one
    bfloat16 pair per token and layer, a sliding layer its window - 1), more on a document too short for the
    sliding windows to fit in B (they and the full-attention layer's sinks), less where every pair fits."""
    model = tiny_hybrid_gemma(["sliding_attention"] * 4 + ["full_attention"])
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held, cache = _served(model, spec, ids)
    missed = [w for w in caught if "so the cache holds more than the target" in str(w.message)]
    uncompressed = 1 * 2 * 32 * 2 * (4 * min(tokens, 63) + tokens)  # KV heads x (key + value) x head_dim x bf16
    assert 0 <= _served(model, "dynamic", ids)[0] - uncompressed <= 16 * 5  # the layers' own counters
    promised = study.promised_bytes(spec, model.config, tokens, 2)
    assert promised == pytest.approx(held, abs=2 * (2 * 32 * 2 + 4) + 64)  # two pairs and the layers' bookkeeping
    share = float(spec.split("=")[1].partition("+")[0])
    full = cache.layers[-1].store.held_pairs().sum()
    if full >= tokens:  # every pair fits
        assert held <= share * uncompressed and not missed
    elif full > 4:  # the ranking bought pairs: B of the bytes, to a pair
        assert share * uncompressed - (2 * 32 * 2 + 4) - 64 <= held <= share * uncompressed and not missed
    else:  # the sliding windows alone hold more than B: the ranked layer keeps its sinks only, and the cache says so
        assert held > share * uncompressed
        assert len(missed) == 1 and f"bytes={share}" in str(missed[0].message)


@pytest.mark.parametrize("spec,match", [
    ("kvzip:bytes=0", "bytes must be a number in \\(0, 1\\]"),
    ("kvzip:bytes=1.5", "bytes must be a number in \\(0, 1\\]"),
    ("kvzip:bytes=nan", "bytes must be a number in \\(0, 1\\]"),
    ("kvzip:bytes=0.25,ratio=0.5", "one of budget .* ratio .* or bytes"),
    ("kvzip:bytes=0.25,budget=64", "one of budget .* ratio .* or bytes"),
    ("kvzip:bytes=0.25,budgets=layer", "bytes= .* needs budgets=head"),
])
def test_bad_bytes_are_refused_naming_the_parameter(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_bytes_needs_the_config():
    with pytest.raises(ValueError, match="bytes= needs config=model.config"):
        make_cache("kvzip:bytes=0.25")
