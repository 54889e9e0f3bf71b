"""shared_heads on pure tensors: the group mean is stored once, bytes shrink by the group size, bad groups refused."""

import pytest
import torch

from hf_kvcompress.codecs.base import agree_within_groups, gather_encoded
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.codecs.shared_heads import SharedHeadsCodec
from hf_kvcompress.registry import parse_spec


def _nbytes(encoded):
    return sum(t.numel() * t.element_size() for t in encoded.values())


def test_each_head_reads_its_group_mean():
    x = torch.randn(2, 4, 5, 8)
    codec = SharedHeadsCodec(heads_per_group=2)
    encoded = codec.encode(x, "key")
    assert encoded["states"].shape == (2, 2, 5, 8)
    out = codec.decode(encoded, "key", torch.float32)
    assert torch.allclose(out[:, 0], (x[:, 0] + x[:, 1]) / 2) and torch.allclose(out[:, 1], out[:, 0])
    assert torch.allclose(out[:, 3], (x[:, 2] + x[:, 3]) / 2)


def test_identical_heads_round_trip_exactly():
    head = torch.randn(1, 1, 6, 16)
    x = head.expand(1, 2, 6, 16).contiguous()
    codec = SharedHeadsCodec(heads_per_group=2)
    assert torch.equal(codec.decode(codec.encode(x, "value"), "value", torch.float32), x)


@pytest.mark.parametrize("storage", [None, IntNCodec(bits=8, key_axis="token"), IntNCodec(bits=4, key_axis="channel")])
def test_bytes_are_one_stored_head_per_group(storage):
    x = torch.randn(2, 6, 64, 64, dtype=torch.float16)
    if storage is None:
        codec = SharedHeadsCodec(heads_per_group=3)
    else:
        codec = SharedHeadsCodec(storage=storage, heads_per_group=3)
    encoded = codec.encode(x, "key")
    assert _nbytes(encoded) == 2 * 6 * 64 * codec.bytes_per_token(64, "key", torch.float16)
    inner = codec.storage.bytes_per_token(64, "key", torch.float16)
    assert codec.bytes_per_token(64, "key", torch.float16) == inner / 3


def test_groups_agree_on_eviction_and_gather_uses_the_group_selection():
    scores = torch.tensor([[[1.0, 5.0, 0.0], [3.0, 0.0, 1.0], [9.0, 9.0, 9.0], [0.0, 0.0, 0.0]]])
    agreed = agree_within_groups(scores, 2)
    assert torch.equal(agreed[:, 0], agreed[:, 1]) and torch.equal(agreed[:, 0], torch.tensor([[2.0, 2.5, 0.5]]))
    codec = SharedHeadsCodec(heads_per_group=2)
    x = torch.randn(1, 4, 3, 8)
    index = torch.tensor([[[0, 2], [0, 2], [1, 2], [1, 2]]])
    picked = codec.decode(gather_encoded(codec.encode(x, "key"), index), "key", torch.float32)
    full = codec.decode(codec.encode(x, "key"), "key", torch.float32)
    assert torch.equal(picked[0, :2], full[0, :2, [0, 2]]) and torch.equal(picked[0, 2:], full[0, 2:, [1, 2]])


@pytest.mark.parametrize("bad", [0, 1, -2, 2.5, "two"])
def test_bad_group_size_names_the_parameter(bad):
    with pytest.raises(ValueError, match="heads_per_group"):
        SharedHeadsCodec(heads_per_group=bad)


def test_group_must_divide_kv_heads_and_one_kv_head_is_refused():
    with pytest.raises(ValueError, match=r"allowed: \[2, 4\]"):
        SharedHeadsCodec(heads_per_group=3).encode(torch.randn(1, 4, 2, 8), "key")
    with pytest.raises(ValueError, match="single KV head"):
        SharedHeadsCodec(heads_per_group=2).encode(torch.randn(1, 1, 2, 8), "key")
    with pytest.raises(ValueError, match="config"):
        SharedHeadsCodec().encode(torch.randn(1, 4, 2, 8), "key")


def test_specs_stack_a_storage_codec_and_print_back():
    policy, codec = parse_spec("h2o:budget=64+shared_heads:heads_per_group=2+int4:group_size=16")
    assert codec.storage == IntNCodec(bits=4, group_size=16, rotate="auto", sink_tokens=4,
                                        key_scale="auto")  # int4's name default; the stack drops it when bound
    assert codec.heads_per_group == 2
    from hf_kvcompress.registry import cache_spec

    assert cache_spec(policy, codec) == "h2o:budget=64+shared_heads:heads_per_group=2+int4:group_size=16"
    assert parse_spec("shared_heads+int8")[1].storage == IntNCodec(bits=8)
    with pytest.raises(ValueError, match="can be followed"):
        parse_spec("int8+shared_heads")
    with pytest.raises(ValueError, match="storage"):
        parse_spec("shared_heads:storage=int8+int4")
