"""Codecs on pure tensors: round-trip error per bit width, bit packing, and bytes equal to the promised formula."""

import pytest
import torch

from hf_kvcompress.codecs.base import gather_encoded
from hf_kvcompress.codecs.fp8 import Fp8Codec
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.ops.bitpack import pack, unpack


def _nbytes(encoded):
    return sum(t.numel() * t.element_size() for t in encoded.values())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bitpack_round_trip_and_size(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.12), (3, 0.25), (2, 0.5)])
@pytest.mark.parametrize("kind,axis", [("key", "channel"), ("key", "token"), ("value", None)])
@pytest.mark.parametrize("rotate", ["none", "hadamard", "per_token"])
def test_intn_relative_error_is_bounded(bits, bound, kind, axis, rotate):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    codec = IntNCodec(bits=bits, group_size=32, key_axis=axis, rotate=rotate)
    out = codec.decode(codec.encode(x, kind), kind, torch.float32)
    rel = (out - x).norm() / x.norm()
    assert rel < bound
    # Each value is within half a quantization step of a grid point: max error <= scale / 2 of its group.
    if rotate == "none" or (rotate == "per_token" and axis == "channel"):
        assert (out - x).abs().max() <= (x.max() - x.min()) / (2**bits - 1) / 2 + 1e-2


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("kind,axis", [("key", "channel"), ("key", "token"), ("value", "channel")])
@pytest.mark.parametrize("rotate", ["none", "hadamard", "per_token"])
def test_intn_bytes_match_formula(bits, kind, axis, rotate):
    x = torch.randn(2, 3, 64, 128, dtype=torch.float16)
    codec = IntNCodec(bits=bits, group_size=32, key_axis=axis, rotate=rotate)
    encoded = codec.encode(x, kind)
    assert _nbytes(encoded) == 2 * 3 * 64 * codec.bytes_per_token(128, kind, torch.float16)


def test_int4_group32_is_five_sixteenths_of_fp16():
    # The figure: (4 + 32/32) / 16 of the fp16 bytes, scale and zero point included.
    codec = IntNCodec(bits=4, group_size=32)
    assert codec.bytes_per_token(128, "value", torch.float16) / (128 * 2) == (4 + 32 / 32) / 16


def test_fp8_round_trip_and_bytes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 64) * 5
    codec = Fp8Codec()
    encoded = codec.encode(x, "key")
    out = codec.decode(encoded, "key", torch.float32)
    assert (out - x).norm() / x.norm() < 0.05
    assert _nbytes(encoded) == 2 * 3 * 10 * codec.bytes_per_token(64, "key", torch.float32)
    assert encoded["values"].dtype == torch.float8_e4m3fn


def test_identity_is_exact():
    x = torch.randn(1, 2, 5, 8)
    assert torch.equal(IdentityCodec().decode(IdentityCodec().encode(x, "key"), "key", x.dtype), x)


def test_token_wise_encodings_gather_per_head():
    x = torch.randn(1, 2, 6, 64)
    codec = IntNCodec(bits=8, key_axis="token")
    index = torch.tensor([[[0, 2, 5], [1, 3, 4]]])
    picked = codec.decode(gather_encoded(codec.encode(x, "key"), index), "key", torch.float32)
    full = codec.decode(codec.encode(x, "key"), "key", torch.float32)
    assert torch.equal(picked[0, 0], full[0, 0, [0, 2, 5]])
    assert torch.equal(picked[0, 1], full[0, 1, [1, 3, 4]])


@pytest.mark.parametrize(
    "kwargs,name",
    [({"bits": 5}, "bits"), ({"group_size": 0}, "group_size"), ({"rotate": "random"}, "rotate"),
     ({"sink_tokens": -1}, "sink_tokens"), ({"residual_length": -1}, "residual_length"),
     ({"key_axis": "row"}, "key_axis"), ({"codebook": "nf4"}, "codebook"), ({"wide_bits": 5}, "wide_bits"),
     ({"wide_layers": "1/x"}, "wide_layers"), ({"wide_layers": "-1"}, "wide_layers")],
)
def test_intn_rejects_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        IntNCodec(**kwargs)


def test_channel_keys_refuse_eviction():
    with pytest.raises(ValueError, match="key_axis"):
        IntNCodec(key_axis="channel").for_policy(evicts=True)
    assert IntNCodec().for_policy(evicts=True).key_axis == "token"
    assert IntNCodec().for_policy(evicts=False).key_axis == "channel"


def test_bitpack_three_bits_take_three_bytes_per_eight_values():
    codes = torch.arange(8, dtype=torch.uint8).repeat(2, 4)  # [2, 32]
    packed = pack(codes, 3)
    assert packed.shape == (2, 12) and packed.dtype == torch.uint8
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(2, 12, dtype=torch.uint8), 3)


def _plain_reference(x, bits, group):
    """Per-token min/max quantization in float64, no storage rounding: what the codec approximates."""
    g = x.double().reshape(*x.shape[:-1], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    return (((g - lo) / scale).round() * scale + lo).reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_intn_values_match_a_plain_reference(bits):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 16, 64)
    codec = IntNCodec(bits=bits, group_size=32)
    out = codec.decode(codec.encode(x, "value"), "value", torch.float32).double()
    ref = _plain_reference(x, bits, 32)
    step = (x.reshape(1, 2, 16, 2, 32).amax(-1) - x.reshape(1, 2, 16, 2, 32).amin(-1)) / (2**bits - 1)
    # bf16 storage moves the grid by at most one code step (a rounding tie can flip), never more.
    assert ((out - ref).abs().reshape(1, 2, 16, 2, 32) <= step[..., None] * 1.01 + 1e-6).all()
    assert (out - x.double()).norm() <= (ref - x.double()).norm() * 1.05


def test_scales_do_not_overflow_with_a_large_value():
    # One value of 7e4 in a group: fp16 scales overflowed to inf and the whole group decoded to NaN.
    x = torch.randn(1, 1, 4, 32)
    x[0, 0, 0, 3] = 7e4
    for kind, axis in (("value", None), ("key", "channel")):
        codec = IntNCodec(bits=4, group_size=4, key_axis=axis)
        out = codec.decode(codec.encode(x, kind), kind, torch.float32)
        assert torch.isfinite(out).all()
        assert (out[0, 0, 0, 3] - 7e4).abs() < 7e4 / 15


def test_scales_do_not_vanish_with_tiny_values():
    # Values near 1e-5: fp16 zero points and scales lost about 6% at int8.
    torch.manual_seed(0)
    x = 1e-5 * (1 + torch.rand(1, 2, 8, 64))
    codec = IntNCodec(bits=8, group_size=32)
    out = codec.decode(codec.encode(x, "value"), "value", torch.float32)
    assert ((out - x).abs() / x).max() < 0.01


def test_scale_and_zero_are_rounded_so_nothing_is_clamped():
    # Values far from zero with a small spread: a bf16 zero point rounded to nearest could sit above the minimum.
    torch.manual_seed(0)
    x = 1000 + torch.rand(1, 1, 4, 32)
    codec = IntNCodec(bits=8, group_size=32)
    encoded = codec.encode(x, "value")
    assert encoded["scale"].dtype == torch.bfloat16 and encoded["zero"].dtype == torch.bfloat16
    out = codec.decode(encoded, "value", torch.float32)
    half_step = encoded["scale"].float().amax() / 2
    assert (out - x).abs().max() <= half_step * 1.001


def test_group_size_must_divide_head_dim_for_every_key_axis():
    # Values are grouped along head_dim even when keys are grouped along tokens.
    for axis in ("channel", "token", None):
        with pytest.raises(ValueError, match="group_size"):
            IntNCodec(bits=4, group_size=64, key_axis=axis).check_head_dim(32)
    with pytest.raises(ValueError, match="multiple of 8"):
        IntNCodec(bits=3, group_size=4).check_head_dim(36)
    IntNCodec(bits=3, group_size=32).check_head_dim(64)


def test_a_cache_refuses_a_group_size_that_does_not_divide_head_dim_when_built():
    from hf_kvcompress import make_cache
    from tests.caches.tiny_models import CONFIGS

    config = CONFIGS["gemma3"]()  # head_dim 32
    with pytest.raises(ValueError, match="group_size"):
        make_cache("int4:group_size=64", config)
    make_cache("int4:group_size=32", config)


def _two_bit_key_errors(x, key_axis, rotations):
    """Relative round-trip error of x stored as 2-bit keys, per rotation."""
    errors = {}
    for rotate in rotations:
        codec = IntNCodec(bits=2, group_size=32, key_axis=key_axis, rotate=rotate)
        out = codec.decode(codec.encode(x, "key"), "key", torch.float32)
        errors[rotate] = ((out - x).norm() / x.norm()).item()
    return errors


def test_rotation_lowers_the_error_when_a_channel_is_an_outlier():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 64, 64)
    x[..., 7] *= 30  # one outlier channel, as in real keys
    errors = _two_bit_key_errors(x, "token", ("none", "hadamard"))
    assert errors["hadamard"] < 0.8 * errors["none"]  # measured 0.28 vs 0.38


def test_per_token_rotation_turns_only_the_groups_along_head_dim():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 64, 64)
    for axis in ("channel", "token"):
        only, both, neither = (IntNCodec(bits=2, group_size=32, key_axis=axis, rotate=r).for_layer(3)
                               for r in ("per_token", "hadamard", "none"))
        keys_like = neither if axis == "channel" else both
        assert torch.equal(only.encode(x, "key")["codes"], keys_like.encode(x, "key")["codes"])
        assert torch.equal(only.encode(x, "value")["codes"], both.encode(x, "value")["codes"])
        assert not torch.equal(only.encode(x, "value")["codes"], neither.encode(x, "value")["codes"])
        q = torch.randn(2, 2, 1, 64)
        assert torch.equal(only.to_basis(q, "key"), keys_like.to_basis(q, "key"))


def test_rotating_keys_raises_the_error_when_a_few_tokens_spike_in_single_channels():
    """One case where rotating per-channel keys hurts (what `rotate=per_token` avoids; on Gemma-3's keys docs/results.md
    measures another): a per-channel group confines one token's spike in one channel to that channel's scale, the
    rotation spreads it over every channel and widens every channel's range in that group."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 64)
    spikes = torch.randint(0, 256, (2, 8))
    for head in range(2):
        x[0, head, spikes[head], (spikes[head] * 7) % 64] = 40.0
    errors = _two_bit_key_errors(x, "channel", ("hadamard", "per_token"))
    assert errors["per_token"] < 0.8 * errors["hadamard"]  # measured 0.37 vs 0.50


def test_each_layer_rotates_with_its_own_signs():
    x = torch.randn(1, 1, 4, 64)
    codec = IntNCodec(bits=4, group_size=32, rotate="hadamard")
    first, second = codec.for_layer(0), codec.for_layer(1)
    assert first.layer == 0 and second.layer == 1 and codec.for_layer(1) == second
    assert not torch.equal(first.encode(x, "value")["codes"], second.encode(x, "value")["codes"])
    for layered in (first, second):
        out = layered.decode(layered.encode(x, "value"), "value", torch.float32)
        assert (out - x).norm() / x.norm() < 0.15
    assert IntNCodec(rotate="none").for_layer(3).layer == 0  # nothing to seed without a rotation


def test_fp8_sink_tokens_are_checked_and_reach_the_spec():
    from hf_kvcompress import parse_spec

    with pytest.raises(ValueError, match="sink_tokens"):
        Fp8Codec(sink_tokens=-2)
    assert parse_spec("fp8:sink_tokens=4")[1] == Fp8Codec(sink_tokens=4)


@pytest.mark.parametrize(
    "spec",
    ["int8", "int4", "int3", "int2", "int4:rotate=none", "int2:sink_tokens=0", "int4:rotate=none,sink_tokens=0",
     "int3:rotate=hadamard,sink_tokens=8,group_size=16", "h2o:budget=64,recent=16+int4:rotate=none",
     "fp8:sink_tokens=4", "int2:codebook=gaussian", "int3:codebook=uniform", "int2:pre_rope=false",
     "int4:pre_rope=true,codebook=gaussian"],
)
def test_specs_rebuild_the_same_cache(spec):
    from hf_kvcompress import make_cache, parse_spec
    from tests.caches.tiny_models import CONFIGS

    config = CONFIGS["llama"]()  # pre_rope (in int2's defaults) reads the RoPE frequencies from it
    cache = make_cache(spec, config)
    assert parse_spec(cache.spec) == parse_spec(spec)
    assert make_cache(cache.spec, config).codec == cache.codec


def test_plain_names_settle_the_rotation_per_model_family():
    from transformers import Gemma3TextConfig

    from hf_kvcompress import make_cache, parse_spec
    from hf_kvcompress.caches.compressed import CompressedCache
    from tests.caches.tiny_models import CONFIGS

    gemma = Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, intermediate_size=64, vocab_size=64, sliding_window=16,
                             layer_types=["sliding_attention", "full_attention"])
    x = torch.randn(1, 1, 64, 64)
    for bits in (4, 3, 2):
        assert parse_spec(f"int{bits}")[1].rotate == "auto"
        on_llama = make_cache(f"int{bits}", CONFIGS["llama"]())
        on_gemma = CompressedCache(codec=parse_spec(f"int{bits}")[1], config=gemma)
        assert on_llama.codec.settled_rotation == "hadamard" and on_gemma.codec.settled_rotation == "per_token"
        assert on_llama.spec == on_gemma.spec == f"int{bits}"  # the spec is what the user asked for
        sliding, full = (layer.codec for layer in on_gemma.layers)
        explicit = CompressedCache(codec=parse_spec(f"int{bits}:rotate=per_token")[1], config=gemma).layers[1].codec
        for kind in ("key", "value"):
            assert torch.equal(full.encode(x, kind)["codes"], explicit.encode(x, kind)["codes"])
        # Sliding layers keep per-channel keys too (a block window, layer.py `_drop_old_blocks`): unrotated there too.
        assert not full._rotates("key") and not sliding._rotates("key") and full._rotates("value")
        assert sliding.key_axis == "channel" and sliding.settled_rotation == "per_token"
        # An explicit choice is kept on every model.
        explicit = CompressedCache(codec=parse_spec(f"int{bits}:rotate=hadamard")[1], config=gemma)
        assert explicit.codec.settled_rotation == ""
    # Without a config (int4 needs none) `auto` rotates everything, as hadamard does, bit for bit.
    unbound = parse_spec("int4")[1].for_layer(1)
    hadamard = IntNCodec(bits=4, rotate="hadamard", sink_tokens=4).for_layer(1)
    for kind in ("key", "value"):
        codes = [codec.for_policy(False).encode(x, kind)["codes"] for codec in (unbound, hadamard)]
        assert torch.equal(*codes)


def test_quantized_cache_uses_the_plain_names_configuration():
    from hf_kvcompress import QuantizedCache, parse_spec
    from tests.caches.tiny_models import CONFIGS

    config = CONFIGS["llama"]()
    for bits in (2, 3, 4, 8):
        assert QuantizedCache(bits=bits, config=config).codec == parse_spec(f"int{bits}")[1].for_policy(False)
    with pytest.raises(ValueError, match="bits"):
        QuantizedCache(bits=5)


def test_plain_int2_carries_the_two_bit_options_and_asks_for_the_config():
    from hf_kvcompress import QuantizedCache, make_cache, parse_spec

    codec = parse_spec("int2")[1]
    assert (codec.rotate, codec.sink_tokens, codec.codebook, codec.pre_rope) == ("auto", 4, "gaussian", True)
    for build in (lambda: make_cache("int2"), lambda: QuantizedCache(bits=2)):
        with pytest.raises(ValueError, match="config"):
            build()
    assert make_cache("int2:pre_rope=false").spec == "int2:pre_rope=False"


def test_caches_give_each_layer_its_rotation_with_or_without_config():
    from hf_kvcompress import make_cache
    from tests.caches.tiny_models import tiny_model

    model = tiny_model("llama")
    with_config = make_cache("int4", model.config)
    assert [layer.codec.layer for layer in with_config.layers] == [0, 1]
    without = make_cache("int4")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 5)), cache=without)
    assert [layer.codec.layer for layer in without.layers] == [0, 1]


def test_lloyd_max_levels_match_max_1960():
    from hf_kvcompress.codecs.gaussian_levels import lloyd_max_levels

    # Max (1960), Table I: the optimal 4-level quantizer of N(0, 1) has outputs +-0.4528 and +-1.510.
    assert lloyd_max_levels(2) == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-4)
    for bits in (1, 2, 3, 4, 8):
        levels = lloyd_max_levels(bits)
        assert len(levels) == 2**bits and list(levels) == sorted(levels)
        assert levels == pytest.approx(tuple(-x for x in reversed(levels)), abs=1e-9)
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_levels(9)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("kind,axis", [("key", "channel"), ("key", "token"), ("value", None)])
def test_gaussian_codebook_round_trip_and_bytes(bits, kind, axis):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    codec = IntNCodec(bits=bits, group_size=32, key_axis=axis, codebook="gaussian")
    encoded = codec.encode(x, kind)
    out = codec.decode(encoded, kind, torch.float32)
    # The Lloyd-Max mean squared error of N(0, 1): 0.1175 at 2 bits, 0.0345 at 3, 0.0095 at 4 (plus sampling);
    # per-channel key groups stay on the min/max grid and keep its bounds.
    bound = ({2: 0.5, 3: 0.25, 4: 0.12, 8: 0.01} if axis == "channel" else {2: 0.37, 3: 0.2, 4: 0.11, 8: 0.01})[bits]
    assert (out - x).norm() / x.norm() < bound
    assert _nbytes(encoded) == 2 * 3 * 64 * codec.bytes_per_token(64, kind, torch.float32)
    plain = IntNCodec(bits=bits).bytes_per_token(64, kind, torch.float32)
    assert codec.bytes_per_token(64, kind, torch.float32) == plain


def test_gaussian_codebook_beats_min_max_at_two_bits_on_gaussian_states():
    # On Gaussian states the Lloyd-Max levels cut the 2-bit error by about a third (not at 3 or 4 bits, where a
    # min/max grid over 32 values is finer than the Lloyd-Max levels).
    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 64)
    errors = {}
    for codebook in ("uniform", "gaussian"):
        codec = IntNCodec(bits=2, group_size=32, key_axis="token", rotate="hadamard", codebook=codebook)
        out = codec.decode(codec.encode(x, "key"), "key", torch.float32)
        errors[codebook] = ((out - x).norm() / x.norm()).item()
    assert errors["gaussian"] < 0.9 * errors["uniform"]


def test_gaussian_codebook_decodes_the_level_the_encoder_chose():
    from hf_kvcompress.codecs.gaussian_levels import levels_tensor

    torch.manual_seed(0)
    x = torch.randn(1, 1, 4, 32) * 3 + 1
    codec = IntNCodec(bits=2, group_size=32, codebook="gaussian")
    encoded = codec.encode(x, "value")
    out = codec.decode(encoded, "value", torch.float32)
    mean, std = encoded["zero"].float(), encoded["scale"].float()
    # Every value decodes to the stored mean plus one of the 4 levels times the stored standard deviation, and to
    # the nearest of them.
    candidates = mean[..., None] + std[..., None] * levels_tensor(2)  # [1, 1, 4, 1, 4]
    distance = (x[..., None] - candidates).abs()
    nearest = candidates.expand_as(distance).gather(-1, distance.argmin(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(out, nearest)


def test_gaussian_codebook_survives_large_and_tiny_values():
    x = torch.randn(1, 1, 4, 32)
    x[0, 0, 0, 3] = 7e4
    tiny = 1e-5 * (1 + torch.rand(1, 1, 4, 32))
    for states in (x, tiny):
        codec = IntNCodec(bits=4, group_size=32, codebook="gaussian")
        out = codec.decode(codec.encode(states, "value"), "value", torch.float32)
        assert torch.isfinite(out).all()
    constant = torch.full((1, 1, 4, 32), 2.5)
    codec = IntNCodec(bits=2, group_size=32, codebook="gaussian")
    torch.testing.assert_close(codec.decode(codec.encode(constant, "value"), "value", torch.float32), constant)


def test_gaussian_codebook_leaves_per_channel_key_groups_on_the_min_max_grid():
    # One channel's run of tokens is not Gaussian after the rotation (measured: Lloyd-Max levels raised that error).
    x = torch.randn(1, 2, 64, 64)
    uniform = IntNCodec(bits=2, key_axis="channel", rotate="hadamard")
    gaussian = IntNCodec(bits=2, key_axis="channel", rotate="hadamard", codebook="gaussian")
    assert torch.equal(uniform.encode(x, "key")["codes"], gaussian.encode(x, "key")["codes"])
    assert not torch.equal(uniform.encode(x, "value")["codes"], gaussian.encode(x, "value")["codes"])


def _rope_keys(inv_freq, tokens=64, noise=0.05):
    """Keys that are one fixed vector before RoPE (plus a little noise), rotated to positions 0..tokens-1."""
    from hf_kvcompress.ops.rerotate import rerotate

    torch.manual_seed(0)
    d = 2 * inv_freq.shape[0]
    base = torch.randn(1, 2, 1, d) * 3 + noise * torch.randn(1, 2, tokens, d)
    return rerotate(base, torch.arange(tokens, dtype=torch.float32).expand(1, 2, tokens), inv_freq)


def _with_inv_freq(codec, inv_freq):
    """The codec as `for_model` binds it, with these RoPE frequencies instead of a config's."""
    import copy

    bound = copy.copy(codec)
    object.__setattr__(bound, "inv_freq", tuple(inv_freq.tolist()))
    return bound


def test_pre_rope_keys_lose_less_than_post_rope_keys():
    # Post-RoPE, a channel spins with position inside a group and its min/max range widens; rotated back to the
    # group's first position, the group's channels are nearly constant again (KVQuant's reason for pre-RoPE keys).
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    keys = _rope_keys(inv_freq)
    errors = {}
    for pre_rope in (False, True):
        codec = _with_inv_freq(IntNCodec(bits=2, group_size=16, key_axis="channel", pre_rope=pre_rope), inv_freq)
        out = codec.decode(codec.encode(keys, "key"), "key", torch.float32)
        errors[pre_rope] = ((out - keys).norm() / keys.norm()).item()
    assert errors[True] < 0.3 * errors[False]


def test_pre_rope_is_exact_on_the_way_back_and_leaves_values_and_token_keys_alone():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    keys = _rope_keys(inv_freq, tokens=32)
    codec = _with_inv_freq(IntNCodec(bits=8, group_size=8, key_axis="channel", pre_rope=True), inv_freq)
    # Rotating back and forth alone is lossless to float32 rounding.
    torch.testing.assert_close(codec._group_rope(codec._group_rope(keys, -1), 1), keys, atol=1e-5, rtol=1e-5)
    plain = IntNCodec(bits=8, group_size=8, key_axis="channel")
    assert torch.equal(codec.encode(keys, "value")["codes"], plain.encode(keys, "value")["codes"])
    token = _with_inv_freq(IntNCodec(bits=8, group_size=8, key_axis="token", pre_rope=True), inv_freq)
    plain = IntNCodec(bits=8, group_size=8, key_axis="token")
    assert torch.equal(token.encode(keys, "key")["codes"], plain.encode(keys, "key")["codes"])


@pytest.mark.parametrize("rotary", [64, 32])  # 32 of 64 dims: a partial-rotary model leaves the rest alone
@pytest.mark.parametrize("rotate", ["hadamard", "none"])
def test_offset_queries_are_the_query_turned_back_by_each_offset(rotate, rotary):
    """Row o of `offset_queries` is the plain query turned back by o positions (_group_rope of o copies), then
    taken to the storage basis: the cached turning table gives exactly what building it each step gave."""
    from hf_kvcompress.ops.hadamard import rotate_batch_rows, rotate_rows

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    codec = _with_inv_freq(IntNCodec(bits=2, group_size=32, key_axis="channel", pre_rope=True, rotate=rotate), inv_freq)
    query = torch.randn(2, 3, 3, 64)
    got = codec.offset_queries(query)
    plain = rotate_rows(query, codec._seed("key"), inverse=True) if rotate == "hadamard" else query
    copies = plain[:, :, :, None].expand(2, 3, 3, 32, 64).reshape(2, 3, 96, 64)
    expected = codec._group_rope(copies, -1)
    if rotate == "hadamard":
        expected = rotate_batch_rows(expected, codec._seed("key"))
    assert got.shape == (2, 3, 3, 32, 64)
    assert torch.equal(got, expected.reshape(2, 3, 3, 32, 64))
    assert not torch.equal(got[:, :, :, 1], got[:, :, :, 0])  # the offsets do turn


def test_pre_rope_needs_the_models_config_and_a_bool():
    from hf_kvcompress import make_cache

    with pytest.raises(ValueError, match="pre_rope"):
        IntNCodec(pre_rope="yes")
    with pytest.raises(ValueError, match="config"):
        make_cache("int2:pre_rope=true")
    with pytest.raises(ValueError, match="pre_rope"):
        IntNCodec(pre_rope=True, key_axis="channel").encode(torch.randn(1, 1, 32, 64), "key")
    make_cache("int2:pre_rope=false")  # the other options need no config


def test_wide_layers_store_their_layers_at_wide_bits_and_the_rest_at_bits():
    """Per-layer mixed precision. Layer 0 sees the same inputs in every cache, so with wide_layers=0 it holds
    exactly what an int4 cache with the same options holds there, and with wide_layers=1 what the int2 cache holds;
    the bytes lie between the two widths'."""
    from hf_kvcompress import make_cache, measured_kv_bytes

    from ..caches.tiny_models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    options = "residual_length=4,group_size=8,rotate=hadamard,sink_tokens=2"
    same = "codebook=gaussian,pre_rope=true"  # what the plain int2 carries, and so its wide layers
    specs = (f"int2:{options}", f"int4:{options},{same}", f"int2:{options},wide_layers=0",
             f"int2:{options},wide_layers=1")
    caches = [make_cache(spec, model.config) for spec in specs]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, cache=cache)
    narrow, wide, first_wide, second_wide = caches
    assert [layer.codec.bits for layer in first_wide.layers] == [4, 2]
    assert [layer.codec.bits for layer in second_wide.layers] == [2, 4]
    for mixed, reference in ((first_wide, wide), (second_wide, narrow)):
        for kind in ("key", "value"):
            torch.testing.assert_close(mixed.layers[0]._full(kind), reference.layers[0]._full(kind), rtol=0, atol=0)
    assert measured_kv_bytes(narrow) < measured_kv_bytes(second_wide) < measured_kv_bytes(wide)
    with pytest.raises(ValueError, match="wide_layers must be decoder layers 0 to 1"):
        make_cache(f"int2:{options},wide_layers=2", model.config)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_codes_are_the_bucket_of_each_normalized_value(bits):
    """The Lloyd-Max codes are what `torch.bucketize` over the decision edges gives: the encoder counts the edges
    strictly below each value instead of searching (at an edge, on either side of it, and through `encode`)."""
    from hf_kvcompress.codecs.gaussian_levels import thresholds_tensor
    from hf_kvcompress.codecs.intn import _bucket

    edges = thresholds_tensor(bits)
    values = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1),
                        torch.randn(1000, generator=torch.Generator().manual_seed(bits)) * 2])
    assert torch.equal(_bucket(values, edges).long(), torch.bucketize(values, edges))
    codec = IntNCodec(bits=bits, group_size=8, key_axis="token", codebook="gaussian", rotate="none")
    x = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(bits))
    encoded = codec.encode(x, "value")
    scale = encoded["scale"].float().repeat_interleave(8, dim=-1)
    mean = encoded["zero"].float().repeat_interleave(8, dim=-1)
    assert torch.equal(unpack(encoded["codes"], bits).long(), torch.bucketize((x - mean) / scale, edges))
