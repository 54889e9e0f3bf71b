"""KVzip's `bytes=B`: the cache holds B of the uncompressed cache's bytes (codec included), on a full-attention and a
hybrid (sliding-window) tiny model, and bad input is refused naming the parameter."""

import pytest
import torch
import transformers

from hf_kvcompress import make_cache, prefill, use_kvcompress_attention
from hf_kvcompress.measure import served_kv_bytes
from hf_kvcompress.registry import parse_spec

from .tiny_models import COMMON

REPEAT = [5, 6, 7]
HYBRID = ["sliding_attention", "sliding_attention", "full_attention"]


def _model(layer_types):
    config = transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": len(layer_types)}, num_key_value_heads=1, head_dim=32, sliding_window=64,
        layer_types=layer_types, max_position_embeddings=1024,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return use_kvcompress_attention(model)


def _served(model, spec, ids):
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    return served_kv_bytes(cache, torch.bfloat16), cache


@pytest.mark.parametrize("layer_types", [HYBRID, ["full_attention"] * 2], ids=["hybrid", "full"])
@pytest.mark.parametrize("spec,share", [("kvzip:bytes=0.25", 0.25), ("kvzip:bytes=0.5", 0.5),
                                        ("kvzip:bytes=0.1+int4", 0.1), ("kvzip:bytes=0.2+int8", 0.2)])
def test_the_cache_holds_the_share_of_the_uncompressed_bytes(layer_types, spec, share):
    model = _model(layer_types)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    reference, _ = _served(model, "dynamic", ids)  # the eval's uncompressed cache (a sliding layer: its window)
    held, cache = _served(model, spec, ids)
    head, _, codec = spec.partition("+")  # the spec names the span the layout chose: 4 with sliding layers, else 0
    span = 4 if "sliding_attention" in layer_types else 0
    assert cache.spec == f"{head},span={span}" + (f"+{codec}" if codec else "")
    # Never above (span re-chooses pairs within a head's residual and encoded slots separately, so the pairs cost
    # what the ranking paid), and below by little: the pair that did not fit, the sliding layers' rounding.
    assert 0.93 * share <= held / reference <= share, held / reference
    # The byte count and the ratio it stands for differ where the codec compresses: int4 keeps more pairs.
    kept = sum(layer.store.held_pairs().sum() for layer in cache.layers if layer.per_head)
    if "int4" in spec:
        assert kept > share * 400 * sum(t == "full_attention" for t in layer_types)


def test_span_zero_spends_the_bytes_to_a_pair():
    """Without span re-choosing pairs, the ranking buys pairs exactly up to the target (less under one pair)."""
    model = _model(["full_attention"] * 2)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    held, cache = _served(model, "kvzip:bytes=0.1,span=0+int4", ids)
    target = cache.byte_target.uncompressed(torch.tensor([400])) * 0.1
    pair = 2 * 32 * 2 + 4  # the dearest pair: full precision with its score
    assert target - pair - 64 <= held <= target + 64  # 64: the layers' small bookkeeping


def test_a_hybrid_model_shares_the_sliding_layers_as_a_ratio_of_b_does():
    model = _model(HYBRID)
    got = [layer.policy for layer in make_cache("kvzip:bytes=0.25", model.config).layers[:2]]
    same = [layer.policy for layer in make_cache("kvzip:ratio=0.25", model.config).layers[:2]]
    assert got == same


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
