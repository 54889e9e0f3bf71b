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


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bitpack_round_trip_and_size(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.12), (2, 0.5)])
@pytest.mark.parametrize("kind,axis", [("key", "channel"), ("key", "token"), ("value", None)])
def test_intn_relative_error_is_bounded(bits, bound, kind, axis):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    codec = IntNCodec(bits=bits, group_size=32, key_axis=axis)
    out = codec.decode(codec.encode(x, kind), kind, torch.float32)
    rel = (out - x).norm() / x.norm()
    assert rel < bound
    # Each value is within half a quantization step of a grid point: max error <= scale / 2 of its group.
    assert (out - x).abs().max() <= (x.max() - x.min()) / (2**bits - 1) / 2 + 1e-2


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind,axis", [("key", "channel"), ("key", "token"), ("value", "channel")])
def test_intn_bytes_match_formula(bits, kind, axis):
    x = torch.randn(2, 3, 64, 128, dtype=torch.float16)
    codec = IntNCodec(bits=bits, group_size=32, key_axis=axis)
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
    [({"bits": 3}, "bits"), ({"group_size": 0}, "group_size"), ({"residual_length": -1}, "residual_length"),
     ({"key_axis": "row"}, "key_axis")],
)
def test_intn_rejects_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        IntNCodec(**kwargs)


def test_channel_keys_refuse_eviction():
    with pytest.raises(ValueError, match="key_axis"):
        IntNCodec(key_axis="channel").for_policy(evicts=True)
    assert IntNCodec().for_policy(evicts=True).key_axis == "token"
    assert IntNCodec().for_policy(evicts=False).key_axis == "channel"
