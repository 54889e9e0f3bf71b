"""int4's scale groups per kind (`key_group_size`, `value_group_size`; None: `group_size`): each kind is stored as
the codec with that kind's group as its `group_size` stores it, bit for bit; its bytes are that kind's; the spec
names a kind's group only where given; a bad size is refused by name; a lowrank stack's ranks follow the groups
that run along the channels (the values', and the keys' only where keys are grouped per token)."""

import pytest
import torch

from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, parse_spec, save_cache
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.generation import generate

from .lowrank_tiny import llama_with_bases, with_bases


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, joint bases dir): 2 layers, 2 KV heads, head_dim 32 (a latent width of 64)."""
    return llama_with_bases(tmp_path_factory)


def _states(tokens=128, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(2, 3, tokens, dim, generator=g)
    states[..., 5] += 40.0  # an outlier channel, as keys have
    return states


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("rotate", ["none", "hadamard"])
def test_each_kind_is_stored_as_its_own_group_size_stores_it(axis, rotate):
    states = _states()
    # key_group_size is the token length of per-channel key groups; keys grouped per token keep group_size (32).
    key_group = 64 if axis == "channel" else None
    split = IntNCodec(bits=4, group_size=32, key_group_size=key_group, value_group_size=16, key_axis=axis,
                      rotate=rotate)
    as_keys = IntNCodec(bits=4, group_size=64 if axis == "channel" else 32, key_axis=axis, rotate=rotate)
    as_values = IntNCodec(bits=4, group_size=16, key_axis=axis, rotate=rotate)
    for kind, reference in (("key", as_keys), ("value", as_values)):
        encoded, expected = split.encode(states, kind), reference.encode(states, kind)
        assert encoded.keys() == expected.keys()
        for name in encoded:
            assert torch.equal(encoded[name], expected[name]), (kind, name)
        assert torch.equal(split.decode(encoded, kind, torch.float32), reference.decode(expected, kind, torch.float32))
        assert split.token_block(kind) == reference.token_block(kind)
        assert split.bytes_per_token(64, kind, torch.bfloat16) == reference.bytes_per_token(64, kind, torch.bfloat16)
    if axis == "channel":  # KIVI keys: one scale per 64 tokens and channel
        assert split.encode(states, "key")["scale"].shape == (2, 3, 2, 64)
        assert split.token_block("key") == 64
        assert split.bytes_per_token(64, "key", torch.bfloat16) == 64 * 4 / 8 + 64 * 4 / 64
    # Values: one scale per 16 channels and token. The bytes: packed codes + a bf16 scale and zero point per group.
    assert split.encode(states, "value")["scale"].shape == (2, 3, 128, 4)
    assert split.bytes_per_token(64, "value", torch.bfloat16) == 64 * 4 / 8 + 64 * 4 / 16


def test_attention_reads_each_kind_with_its_group():
    """The planes' logits and value mix (codecs/plane_attention.py) with a kind's group equal the decoded states'."""
    states, values = _states(seed=1), _states(seed=2)
    query = torch.randn(2, 3, 4, 64, generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(torch.randn(2, 3, 4, 128, generator=torch.Generator().manual_seed(4)), -1)
    for axis, key_group in (("channel", 64), ("token", None)):
        codec = IntNCodec(bits=4, group_size=32, key_group_size=key_group, value_group_size=16, key_axis=axis)
        keys, mixed = codec.encode(states, "key"), codec.encode(values, "value")
        decoded_keys = codec.decode(keys, "key", torch.float32)
        decoded_values = codec.decode(mixed, "value", torch.float32)
        torch.testing.assert_close(codec.key_logits(keys, query), query @ decoded_keys.transpose(-1, -2),
                                   rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(codec.mix_values(mixed, probs), probs @ decoded_values, rtol=1e-5, atol=1e-4)


def test_plain_codes_name_each_kinds_group():
    codec = IntNCodec(bits=4, group_size=32, key_group_size=64, value_group_size=16, key_axis="channel")
    device = torch.device("cpu")
    assert codec.plain_codes("key", 64, 128, device).group_size == 64
    assert codec.plain_codes("value", 64, 128, device).group_size == 16


@pytest.mark.parametrize("bad", [0, -32, 1.5, True, "wide"])
@pytest.mark.parametrize("name", ["key_group_size", "value_group_size"])
def test_a_bad_group_is_refused_by_name(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer or none \(group_size's\), got"):
        IntNCodec(bits=4, **{name: bad})


def test_a_group_that_does_not_divide_the_head_is_refused_by_name():
    with pytest.raises(ValueError, match=r"value_group_size must divide head_dim \(64\), got 48"):
        IntNCodec(bits=4, value_group_size=48).check_head_dim(64)
    IntNCodec(bits=4, key_group_size=48, key_axis="channel").check_head_dim(64)  # tokens, not channels
    # An unsettled axis that an evicting policy settles per token: the keys keep group_size's channel groups.
    evicting = IntNCodec(bits=4, key_group_size=64).for_policy(True)
    assert (evicting.key_axis, evicting.group("key"), evicting.token_block("key")) == ("token", 32, 1)
    assert IntNCodec(bits=4, key_group_size=64).for_policy(False).token_block("key") == 64


def test_the_spec_names_a_kinds_group_only_where_given():
    assert parse_spec("int4:key_group_size=64")[1].spec() == "int4:key_group_size=64"
    assert parse_spec("int4")[1].spec() == "int4"
    codec = parse_spec("int4:key_group_size=none,value_group_size=64")[1]
    assert (codec.group("key"), codec.group("value")) == (32, 64) and codec.spec() == "int4:value_group_size=64"
    stacked = parse_spec("lowrank:ratio=0.5+int4:key_group_size=64")[1]
    assert stacked.spec() == "lowrank:residual_length=32,ratio=0.5+int4:residual_length=32,key_group_size=64"
    assert parse_spec(stacked.spec())[1] == stacked


def test_lowrank_ranks_follow_the_groups_along_the_channels(llama):
    model, bases = llama  # latent width 64
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ranks = {}
    base = "lowrank:ratio=0.5+int4:key_group_size=32,value_group_size=32"  # int4's own groups (not the stack's)
    for spec in (base, "lowrank:ratio=0.5+int4:key_group_size=128,value_group_size=32",
                 "lowrank:ratio=0.5+int4:key_group_size=32,value_group_size=64"):
        cache = make_cache(with_bases(bases, spec), model.config)
        generate(model, ids, mask, cache, max_new_tokens=2)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        ranks[spec] = cache.codec._ranks
    # Per-channel key groups run along tokens: the ranks are the plain stack's; value groups of 64 step the ranks by 64.
    assert ranks["lowrank:ratio=0.5+int4:key_group_size=128,value_group_size=32"] == ranks[base]
    values = [pair[1] for pair in ranks["lowrank:ratio=0.5+int4:key_group_size=32,value_group_size=64"]]
    assert all(rank % 64 == 0 for rank in values)
    with pytest.raises(ValueError, match=r"value_group_size \(with group_size where keys are grouped per token\) "
                                         r"of the storage .* latent width .* = 64\).*got 128"):
        make_cache(with_bases(bases, "lowrank:ratio=0.5+int4:value_group_size=128"), model.config)


def test_fewer_key_scales_fewer_bytes_and_a_round_trip(llama, tmp_path):
    model, bases = llama
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    plain = make_cache(with_bases(bases, "lowrank:ratio=0.5+int4:key_group_size=32,value_group_size=32"), model.config)
    wide = make_cache(with_bases(bases, "lowrank:ratio=0.5+int4:key_group_size=128,value_group_size=32"), model.config)
    for cache in (plain, wide):
        generate(model, ids, mask, cache, max_new_tokens=3)
    # 303 tokens, 32 whole: per-channel key groups of 128 encode 256 of them, groups of 32 all 256 too (271 // 32
    # = 8 groups); the keys' scales and zero points are a quarter as many.
    first, other = plain.layers[0], wide.layers[0]
    assert first.n_encoded == other.n_encoded == 256
    key_scales = [layer.store.encoded_keys["scale"].numel() for layer in (first, other)]
    assert key_scales[0] == 4 * key_scales[1]
    assert measured_kv_bytes(wide) < measured_kv_bytes(plain)
    save_cache(wide, tmp_path / "wide")
    loaded = load_cache(tmp_path / "wide", model=model)
    assert loaded.spec == wide.spec and loaded.codec == wide.codec
    assert measured_kv_bytes(loaded) == measured_kv_bytes(wide) == loaded.promised_kv_bytes()
    more = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(input_ids=more, cache=wide).logits
        after = model(input_ids=more, cache=loaded).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
