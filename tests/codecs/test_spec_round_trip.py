"""Every field that changes what a codec stores survives its spec string: `parse_spec(codec.spec())` builds the same
codec, so a saved cache (whose file records the spec) is loaded into the codec that wrote it."""

import dataclasses
from functools import partial

import pytest

from hf_kvcompress.caches.compressed import cache_spec
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.codecs.reducing import ReducingCodec
from hf_kvcompress.policies.heavy_hitter import HeavyHitterPolicy
from hf_kvcompress.policies.keep_all import KeepAllPolicy
from hf_kvcompress.registry import CODECS, parse_spec

# Non-default settings of every codec, at least one for each of its fields (checked below), several fields per spec.
SETTINGS = [
    "fp8:sink_tokens=3",
    "int8:group_size=16,residual_length=0,key_axis=token",
    "int8:key_axis=channel,rotate=hadamard,codebook=gaussian,pre_rope=true",
    "int4:key_axis=token",
    "int4:key_group_size=64,value_group_size=16",
    "lowrank:ratio=0.5+int4:key_group_size=128,value_group_size=64",
    "int4:key_axis=channel,wide_layers=1/3,wide_bits=8,sink_tokens=0,key_scale=none",
    "int4:rotate=per_token,residual_length=7",
    "int3:key_axis=token,group_size=8",
    "int2:key_axis=token",
    "int2:key_axis=channel,codebook=uniform,pre_rope=false,rotate=none",
    "int2:key_scale=auto,wide_layers=0,wide_bits=2",
    "lowrank:rank=8,floor=none,sink_tokens=0,residual_length=3,length=512,compute=float32,bases=somewhere",
    "lowrank:ratio=0.5,allocate=error",
    "lowrank:ratio=0.75,kinds=keys+int8",
    "lowrank:ratio=0.25,allocate=copy,compute=bfloat16",
    "lowrank:ratio=0.5+int4:key_axis=token,residual_length=0",
    "shared_heads:heads_per_group=2,sink_tokens=2",
    "shared_heads:ratio=0.5,maps=somewhere,allocate=residual+int8:key_axis=token",
    "shared_heads+int2:key_axis=channel,group_size=16",
]


def _codec(spec: str):
    policy, codec = parse_spec(spec)
    assert isinstance(policy, KeepAllPolicy)
    return codec


@pytest.mark.parametrize("spec", SETTINGS)
def test_a_codec_spec_builds_the_same_codec(spec):
    codec = _codec(spec)
    assert _codec(codec.spec()) == codec, codec.spec()
    inner = codec.storage if isinstance(codec, ReducingCodec) else None
    if inner is not None:
        assert _codec(inner.spec()) == inner


def _classes():
    """Each registry codec class, once (int8/int4/int3/int2 are partials of IntNCodec)."""
    return {f.func if isinstance(f, partial) else f for f in CODECS.values()}


@pytest.mark.parametrize("cls", sorted(_classes(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_the_settings_change_every_field_of_every_codec(cls):
    """A field that no setting above changes is a field whose round trip nobody checks: add a setting for it."""
    changed = set()
    for spec in SETTINGS:
        codec = _codec(spec)
        for part in (codec, getattr(codec, "storage", None)):
            if type(part) is cls:
                reference = type(part)(bits=part.bits) if isinstance(part, IntNCodec) else type(part)()
                changed |= {f.name for f in dataclasses.fields(part)
                            if f.init and f.name != "storage" and getattr(part, f.name) != getattr(reference, f.name)}
    fields = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("storage", "bits")}
    assert fields <= changed, sorted(fields - changed)


@pytest.mark.parametrize("evicts", [False, True])
def test_a_key_axis_the_policy_settled_is_left_to_the_policy(evicts):
    """`int4` under keep-all settles per-channel keys and under an eviction per-token ones: the spec says `int4`
    either way (the policy settles it again), while a key_axis given is written."""
    policy = HeavyHitterPolicy(budget=8, recent=2) if evicts else KeepAllPolicy()
    settled = _codec("int4").for_policy(evicts)
    assert settled.key_axis == ("token" if evicts else "channel")
    assert settled.spec() == "int4"
    given = _codec("int4:key_axis=token").for_policy(evicts)
    assert given.spec() == "int4:key_axis=token"
    assert parse_spec(cache_spec(policy, given))[1] == _codec("int4:key_axis=token")

