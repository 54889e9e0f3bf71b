"""The C++ decode-attention kernel (ops/cpu_decode.cpp) equals the PyTorch path it replaces on CPU."""

import copy
import functools
import os
import warnings

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcompress import make_cache
from hf_kvcompress.caches import layer as layer_module
from hf_kvcompress.caches import store_attention
from hf_kvcompress.caches.store_attention import attend_store, store_kernel
from hf_kvcompress.codecs.fp8 import Fp8Codec
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.hf.attention import kvcompress_attention
from hf_kvcompress.ops import cpu_decode

from ..caches.tiny_models import write_key_scales

if not cpu_decode.available():  # builds it once per machine (about a minute), then loads it from torch's cache
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)

CODECS = {
    "int4 keys per channel": IntNCodec(bits=4, group_size=16, key_axis="channel"),
    "int4 keys per token": IntNCodec(bits=4, group_size=16, key_axis="token"),
    "int2 keys per channel": IntNCodec(bits=2, group_size=16, key_axis="channel"),
    "int2 per token, Lloyd-Max levels": IntNCodec(bits=2, group_size=8, key_axis="token", codebook="gaussian"),
    "int8 keys per channel": IntNCodec(bits=8, group_size=32, key_axis="channel"),
    "int8 keys per token": IntNCodec(bits=8, group_size=8, key_axis="token"),
    "fp8": Fp8Codec(),
}


# 32, 64 and 128: compiled in (64 and 128 also read by the AVX-512 paths); 48: the run-time loops.
@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 6])  # query rows per KV head: the AVX-512 keys take them 4 at a time
@pytest.mark.parametrize("dim", [32, 48, 64, 128])
@pytest.mark.parametrize("name", CODECS)
def test_partials_equal_softmax_over_decoded_states(name, dim, rows, vectorised):
    codec = CODECS[name]
    if dim % getattr(codec, "group_size", 1):
        pytest.skip("the group does not divide this head_dim")
    g = torch.Generator().manual_seed(len(name))
    batch, heads, tokens = 2, 2, 160  # 160: two whole tiles of 64 and a partial one (of 16 + 16 tokens)
    keys = torch.randn(batch, heads, tokens, dim, generator=g) * 2
    values = torch.randn(batch, heads, tokens, dim, generator=g)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    query = torch.randn(batch, heads, rows, dim, generator=g) * 0.3
    bias = torch.zeros(batch, 1, 1, tokens)
    bias[0, :, :, :100] = float("-inf")  # row 0: its first tile sees nothing and must weigh nothing
    bias[1, :, :, 7] = -3.0
    hidden = torch.tensor([[[5, -1], [64, 159]], [[-1, -1], [0, 100]]])  # slots attended elsewhere (sinks)
    logits = query @ codec.decode(enc_k, "key", torch.float32).transpose(-1, -2) + bias
    slots = torch.where(hidden >= 0, hidden, tokens)
    hide = torch.zeros(batch, heads, tokens + 1, dtype=torch.bool).scatter_(2, slots, True)
    logits.masked_fill_(hide[:, :, None, :tokens], float("-inf"))
    best = logits.amax(-1, keepdim=True)
    probs = torch.exp(logits - best)
    layout_k, layout_v = codec.kernel_layout("key"), codec.kernel_layout("value")
    got_max, got_sum, got_acc = cpu_decode.decode_attention_partials(
        query[:, :, :, None], enc_k, enc_v, layout_k, layout_v, dim, bias, hidden, vectorised
    )
    torch.testing.assert_close(got_max, best, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_sum, probs.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)
    # The output sums up to a few dozen weighted values: float32 rounding in another order, relative to that sum.
    scale = max(1.0, float(probs.sum(-1).max()))
    expected = probs @ codec.decode(enc_v, "value", torch.float32)
    torch.testing.assert_close(got_acc, expected, atol=1e-5 * scale, rtol=1e-5)


SMOLLM2_SHAPES = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             num_hidden_layers=1, intermediate_size=64, vocab_size=64)


def _avx2_build():
    """The kernel built without AVX-512 (-mno-avx512f), so an AVX-512 CPU runs the AVX2 paths (built once per
    machine, then cached as the default build is)."""
    cpu_flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" not in cpu_flags or " fma" not in cpu_flags:
        pytest.skip("this CPU has no AVX2")
    extension = cpu_decode._extension((*cpu_decode.FLAGS, "-mno-avx512f"))
    assert extension is not None and extension.instruction_set() == "avx2"
    return extension


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("spec", ["int2", "int4", "int4:key_axis=token", "int2:key_axis=token,pre_rope=false"])
def test_the_instruction_set_paths_equal_the_portable_one(spec, rows, build):
    """The plain names at SmolLM2's shapes (head_dim 64, key groups of 32 tokens; int2: a query per offset; keys per
    token: groups of 32 channels) read through the instruction-set paths (this CPU's: cpu_decode_avx512.h where it
    has AVX-512; and cpu_decode_avx2.h, built without AVX-512) against the portable loops: a masked first tile,
    hidden slots in partial vectors, a store that ends inside a tile."""
    g = torch.Generator().manual_seed(rows)
    cache = make_cache(spec, SMOLLM2_SHAPES)
    tokens = 128 + 4 * 32 + 5 * 32  # 288 stored (+ the tail): four whole tiles and a half one
    states = torch.randn(2, 3, tokens + 128, 64, generator=g) * 2
    cache.update(states, states.flip(-1), 0, {"position_ids": torch.arange(tokens + 128)[None].expand(2, -1)})
    layer, codec = cache.layers[0], cache.layers[0].codec
    assert layer.n_encoded == tokens
    layout_k, layout_v = codec.kernel_layout("key"), codec.kernel_layout("value")
    query = torch.randn(2, 3, rows, 64, generator=g) * 0.3
    queries = codec.offset_queries(query) if layout_k.offset_queries else query[:, :, :, None]
    bias = torch.zeros(2, 1, 1, tokens)
    bias[0, :, :, :70] = float("-inf")  # row 0: its first tile sees nothing, its second from token 70 on
    hidden = torch.tensor([[[5, -1], [64, 250], [-1, -1]], [[-1, -1], [0, 287], [33, 31]]])
    args = [queries.contiguous(), *cpu_decode._arguments(layer.encoded_keys, layout_k),
            *cpu_decode._arguments(layer.encoded_values, layout_v), 64, bias, hidden]
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    if extension.instruction_set() != "portable":
        paths = extension.vector_paths(*args[1:5], *args[8:12], 64, 64, queries.shape[3])
        assert list(paths) == [True, True]  # keys per channel or per token (reads_keys / reads_token_keys)
    fast = extension.decode_attention_partials(*args, True)
    portable = cpu_decode._extension().decode_attention_partials(*args, False)
    scale = max(1.0, float(portable[1].max()))  # the output sums that many weighted values: rounding relative to it
    torch.testing.assert_close(fast[0], portable[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[1], portable[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[2], portable[2], atol=1e-5 * scale, rtol=1e-5)
    assert (fast[1] > 0).all()


@pytest.mark.parametrize("start", [0, 32], ids=["from slot 0", "from slot 32"])
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
@pytest.mark.parametrize("codec", [IntNCodec(bits=4, group_size=32, key_axis="channel"),
                                   IntNCodec(bits=2, group_size=32, key_axis="token"),
                                   IntNCodec(bits=4, group_size=32, key_axis="token"), Fp8Codec()],
                         ids=["int4 keys per channel", "int2 per token", "int4 per token", "fp8"])
def test_a_room_of_spare_slots_is_read_in_place_as_its_copy(codec, build, start):
    """The store's slots [start, 160) of a room that holds 256 (caches/encoded_room.py; from slot 32: a window
    whose oldest slots were dropped by moving its view, not by a copy): rows of codes and scales at a longer stride
    and from an offset, read without a copy by every path, and read as their contiguous copy is."""
    from hf_kvcompress.caches.encoded_room import EncodedRoom
    from hf_kvcompress.codecs.base import slice_encoded

    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, 3, 160, 64, generator=g) * 2
    keys, values = (slice_encoded(EncodedRoom(codec.encode(x, kind), 160, capacity=256).encoded, start, 160, 160)
                    for x, kind in ((states, "key"), (states.flip(-1), "value")))
    assert all(not t.is_contiguous() for t in [*keys.values(), *values.values()])
    tokens = 160 - start
    layout_k, layout_v = codec.kernel_layout("key"), codec.kernel_layout("value")
    query = torch.randn(2, 3, 3, 64, generator=g) * 0.3
    queries = codec.offset_queries(query) if layout_k.offset_queries else query[:, :, :, None]
    bias = torch.zeros(2, 1, 1, tokens)
    bias[0, :, :, :70] = float("-inf")
    hidden = torch.tensor([[[5, -1], [64, tokens - 10], [-1, -1]], [[-1, -1], [0, tokens - 1], [33, 31]]])

    def partials(k, v):
        args = [queries.contiguous(), *cpu_decode._arguments(k, layout_k), *cpu_decode._arguments(v, layout_v), 64,
                bias, hidden]
        codes, scale = (k["values"], k["scale"]) if layout_k.float8 else (k["codes"], k["scale"])
        assert (args[1].data_ptr(), args[2].data_ptr()) == (codes.data_ptr(), scale.data_ptr())  # no copy
        extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
        return extension.decode_attention_partials(*args, build != "portable")

    copies = [{name: t.contiguous() for name, t in e.items()} for e in (keys, values)]
    for got, expected in zip(partials(keys, values), partials(*copies), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


TOKEN_KEY_CODECS = {  # keys grouped along head_dim per token: every bits, levels and group the key paths read
    "int2 g8": IntNCodec(bits=2, group_size=8, key_axis="token"),
    "int2 g32": IntNCodec(bits=2, group_size=32, key_axis="token"),
    "int2 Lloyd-Max g16": IntNCodec(bits=2, group_size=16, key_axis="token", codebook="gaussian"),
    "int2 Lloyd-Max g64": IntNCodec(bits=2, group_size=64, key_axis="token", codebook="gaussian"),
    "int4 g16": IntNCodec(bits=4, group_size=16, key_axis="token"),
    "int4 g32": IntNCodec(bits=4, group_size=32, key_axis="token"),
    "int8 g8": IntNCodec(bits=8, group_size=8, key_axis="token"),
    "int8 g32": IntNCodec(bits=8, group_size=32, key_axis="token"),
}


def _token_key_case(codec, dim, rows, scale_dtype=torch.bfloat16):
    """Arguments of decode_attention_partials over 150 tokens of 3 x 2 (row, KV head), keys scales in
    `scale_dtype`, with a left-padded row, a masked first tile, hidden slots (sinks) in partial vectors and a store
    that ends inside a tile; and the float64 softmax partials over the decoded states (max, sum, output)."""
    g = torch.Generator().manual_seed(dim + rows)
    batch, heads, tokens = 3, 2, 150  # two whole tiles and a partial one of 16 + 6 tokens
    keys = torch.randn(batch, heads, tokens, dim, generator=g) * 2 + torch.randn(batch, heads, 1, dim, generator=g)
    values = torch.randn(batch, heads, tokens, dim, generator=g)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    in_dtype = {name: enc_k[name].to(scale_dtype) for name in ("scale", "zero") if name in enc_k}  # fp8: no zero
    enc_k = {**enc_k, **in_dtype}
    query = torch.randn(batch, heads, rows, dim, generator=g) * 0.3
    bias = torch.zeros(batch, 1, 1, tokens)
    bias[0, :, :, :100] = float("-inf")  # a masked first tile, and a second masked to token 100
    bias[1, :, :, :37] = float("-inf")  # a left-padded row
    bias[2, :, :, 7] = -3.0
    hidden = torch.tensor([[[5, -1], [64, 149]], [[-1, -1], [0, 100]], [[17, 18], [-1, 140]]])
    args = [query[:, :, :, None].contiguous(), *cpu_decode._arguments(enc_k, codec.kernel_layout("key")),
            *cpu_decode._arguments(enc_v, codec.kernel_layout("value")), dim, bias, hidden]
    # float64 logits over the decoded keys (their scales as the kernel reads them)
    decoded = codec.decode({**enc_k, **{name: t.float() for name, t in in_dtype.items()}}, "key",
                           torch.float32).double()
    logits = query.double() @ decoded.transpose(-1, -2) + bias.double()
    slots = torch.where(hidden >= 0, hidden, tokens)
    hide = torch.zeros(batch, heads, tokens + 1, dtype=torch.bool).scatter_(2, slots, True)
    logits.masked_fill_(hide[:, :, None, :tokens], float("-inf"))
    best = logits.amax(-1, keepdim=True)
    probs = torch.exp(logits - best)
    expected = best, probs.sum(-1, keepdim=True), probs @ codec.decode(enc_v, "value", torch.float32).double()
    return args, expected


def _assert_partials(got, expected):
    scale = max(1.0, float(expected[1].max()))  # the output sums that many weighted values: rounding relative to it
    torch.testing.assert_close(got[0].double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), expected[1], atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(got[2].double(), expected[2], atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16 scales", "fp32 scales"])
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("dim", [48, 64, 128, 256])
@pytest.mark.parametrize("name", TOKEN_KEY_CODECS)
def test_keys_grouped_per_token_take_the_instruction_set_path_and_equal_the_reference(name, dim, rows, scale_dtype,
                                                                                      build):
    """Keys in groups along head_dim with a scale and zero point per token (`int4:key_axis=token`, KVzip's int4
    pairs): the instruction-set key path (`reads_token_keys`, as `vector_paths` reports) against the portable loops
    and a float64 softmax over the decoded states; scales in bf16 (converted per tile) and float32 (read in place);
    one to five query rows (the AVX-512 keys take them 4 at a time)."""
    codec = TOKEN_KEY_CODECS[name]
    if dim % codec.group_size or dim * codec.bits // 8 % 4 or dim // codec.group_size > 16:
        pytest.skip("the groups do not divide this head_dim, or more than 16 of them")
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    args, expected = _token_key_case(codec, dim, rows, scale_dtype)
    if extension.instruction_set() != "portable":
        assert list(extension.vector_paths(*args[1:5], *args[8:12], dim, dim, 1))[0]
    if cpu_decode.instruction_set() != "portable":  # the public answer, for the default build
        layouts = codec.kernel_layout("key"), codec.kernel_layout("value")
        encoded = [codec.encode(torch.zeros(1, 1, 8, dim), kind) for kind in ("key", "value")]
        assert cpu_decode.vector_paths(*encoded, *layouts, dim, dim)[0]
    fast = extension.decode_attention_partials(*args, True)
    portable = cpu_decode._extension().decode_attention_partials(*args, False)
    _assert_partials(fast, expected)
    _assert_partials(portable, expected)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("codec, dim", [(IntNCodec(bits=8, group_size=8, key_axis="token"), 256),
                                        (IntNCodec(bits=2, group_size=8, key_axis="token"), 40)],
                         ids=["32 groups per token", "codes of 10 bytes"])
def test_keys_grouped_per_token_beyond_the_vector_paths_stay_portable(codec, dim, build):
    """What `reads_token_keys` declines (more than 16 groups per token; codes that are not whole 32-bit words) is
    read by the portable loops, and still right."""
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    args, expected = _token_key_case(codec, dim, 3)
    assert not list(extension.vector_paths(*args[1:5], *args[8:12], dim, dim, 1))[0]
    layouts = codec.kernel_layout("key"), codec.kernel_layout("value")
    encoded = [codec.encode(torch.zeros(1, 1, 8, dim), kind) for kind in ("key", "value")]
    assert not cpu_decode.vector_paths(*encoded, *layouts, dim, dim)[0]  # the public answer, the same
    _assert_partials(extension.decode_attention_partials(*args, True), expected)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["fp16 scales", "fp32 scales"])
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("dim", [32, 48, 64, 128, 256])
def test_float8_takes_the_instruction_set_paths_and_equals_the_reference(dim, rows, scale_dtype, build):
    """fp8's E4M3 keys (one scale per token: a group of head_dim) and values through the instruction-set paths (bytes
    to float16 bits, converted 16 or 8 at a time), as `vector_paths` reports, against the portable loops and a float64
    softmax over the decoded states: a left-padded row, a masked first tile, hidden slots in partial vectors, a store
    that ends inside a tile, one to five query rows, the key scales in float16 (as stored) and float32. At head_dim
    48 (3 runs of 16 bytes) the AVX-512 values decline and take the portable loop beside the vector keys."""
    codec = Fp8Codec()
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    args, expected = _token_key_case(codec, dim, rows, scale_dtype)
    if extension.instruction_set() != "portable":
        values_path = extension.instruction_set() == "avx2" or dim != 48
        assert list(extension.vector_paths(*args[1:5], *args[8:12], dim, dim, 1)) == [True, values_path]
    fast = extension.decode_attention_partials(*args, True)
    portable = cpu_decode._extension().decode_attention_partials(*args, False)
    _assert_partials(fast, expected)
    _assert_partials(portable, expected)
    scale = max(1.0, float(portable[1].max()))
    torch.testing.assert_close(fast[2], portable[2], atol=1e-5 * scale, rtol=1e-5)


AVX2_CODECS = {  # at most 8 groups per token at head_dim 128
    "int2 keys per channel": IntNCodec(bits=2, group_size=16, key_axis="channel"),
    "int2 per token, Lloyd-Max levels": IntNCodec(bits=2, group_size=32, key_axis="token", codebook="gaussian"),
    "int4 keys per token": IntNCodec(bits=4, group_size=16, key_axis="token"),
    "int8 keys per channel": IntNCodec(bits=8, group_size=32, key_axis="channel"),
    "fp8": Fp8Codec(),
}


@pytest.mark.parametrize("name", AVX2_CODECS)
def test_the_avx2_paths_give_softmax_over_decoded_states(name):
    """The AVX2 build against the decoded reference at head_dim 128 (4 or 8 groups per token, 2 to 16 runs of 8
    bytes per plane), values through the AVX2 path."""
    extension = _avx2_build()
    codec = AVX2_CODECS[name]
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(1, 2, 96, 128, generator=g) * 2, torch.randn(1, 2, 96, 128, generator=g)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    query = torch.randn(1, 2, 3, 128, generator=g) * 0.3
    logits = query @ codec.decode(enc_k, "key", torch.float32).transpose(-1, -2)
    best = logits.amax(-1, keepdim=True)
    probs = torch.exp(logits - best)
    args = [query[:, :, :, None].contiguous(), *cpu_decode._arguments(enc_k, codec.kernel_layout("key")),
            *cpu_decode._arguments(enc_v, codec.kernel_layout("value")), 128, None, None]
    assert list(extension.vector_paths(*args[1:5], *args[8:12], 128, 128, 1))[1]
    got_max, got_sum, got_acc = extension.decode_attention_partials(*args, True)
    torch.testing.assert_close(got_max, best, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_sum, probs.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)
    scale = max(1.0, float(probs.sum(-1).max()))
    expected = probs @ codec.decode(enc_v, "value", torch.float32)
    torch.testing.assert_close(got_acc, expected, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", [IntNCodec(bits=4, group_size=32), IntNCodec(bits=4, group_size=64),
                                   IntNCodec(bits=2, group_size=64), IntNCodec(bits=8, group_size=16),
                                   IntNCodec(bits=2, group_size=32),
                                   IntNCodec(bits=2, group_size=32, codebook="gaussian"),
                                   IntNCodec(bits=4, group_size=16), IntNCodec(bits=8, group_size=8)],
                         ids=["int4 g32", "int4 g64", "int2 g64", "int8 g16", "int2 g32 (half blocks)",
                              "int2 g32 Lloyd-Max (half blocks)", "int4 g16 (half blocks)", "int8 g8 (half blocks)"])
def test_values_whose_groups_cover_whole_vectors_equal_the_portable_path(codec, scale_dtype):
    """Where a value group runs over whole 16-lane vectors of a plane (int4's groups of 32), the AVX-512 values
    broadcast each group's scale instead of permuting the token's scales; where it runs over half of one (8 columns:
    int2's groups of 32), a broadcast for each half: against the portable loops, with the scales in each dtype the
    kernel reads (converted per tile where they are not float32), over whole and partial tiles."""
    if cpu_decode.instruction_set() != "avx512":
        pytest.skip("the AVX-512 paths are not built here")
    g = torch.Generator().manual_seed(5)
    dim, tokens = 128, 150
    keys, values = torch.randn(2, 2, tokens, dim, generator=g) * 2, torch.randn(2, 2, tokens, dim, generator=g)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    enc_v = {**enc_v, "scale": enc_v["scale"].to(scale_dtype), "zero": enc_v["zero"].to(scale_dtype)}
    args = [torch.randn(2, 2, 3, 1, dim, generator=g) * 0.3, *cpu_decode._arguments(enc_k, codec.kernel_layout("key")),
            *cpu_decode._arguments(enc_v, codec.kernel_layout("value")), dim, None, None]
    assert list(cpu_decode._extension().vector_paths(*args[1:5], *args[8:12], dim, dim, 1))[1]
    fast = cpu_decode._extension().decode_attention_partials(*args, True)
    portable = cpu_decode._extension().decode_attention_partials(*args, False)
    scale = max(1.0, float(portable[1].max()))
    torch.testing.assert_close(fast[2], portable[2], atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("spec", ["int4", "int2", "int4:key_axis=token", "int2:pre_rope=false"])
def test_the_kernels_rotations_equal_the_codecs(spec):
    """`kernel_rotations` and `kernel_turns`: the kernel turns the query by each offset of a key group (int2's
    pre_rope keys), rotates it into the keys' basis and brings the store's output back from the values' itself, as
    the codec's `kernel_queries` and `from_basis` do (up to rounding), and a batch row gives bit for bit what it
    gives alone."""
    g = torch.Generator().manual_seed(11)
    cache = make_cache(spec, SMOLLM2_SHAPES)
    tokens = 160
    states = torch.randn(3, 3, tokens + 128, 64, generator=g) * 2
    cache.update(states, states.flip(-1), 0, {"position_ids": torch.arange(tokens + 128)[None].expand(3, -1)})
    layer, codec = cache.layers[0], cache.layers[0].codec
    key_rotation, value_rotation = codec.kernel_rotations(64, 64, torch.device("cpu"))
    assert key_rotation is not None and value_rotation is not None  # the plain names rotate both (Hadamard)
    turns = codec.kernel_turns(torch.device("cpu"))
    assert (turns is not None) == (spec == "int2")  # a query per offset: pre_rope's per-channel keys
    store = layer.store
    query = torch.randn(3, 3, 3, 64, generator=g) * 0.3

    def attend(rows, in_kernel):
        q = query[rows]
        queries = q[:, :, :, None] if in_kernel else codec.kernel_queries(q)
        parts = [{name: tensor[rows] for name, tensor in encoded.items()}
                 for encoded in (store.encoded_keys, store.encoded_values)]
        stored, plain = cpu_decode.decode_attention(
            queries, q, *parts, codec.kernel_layout("key"), codec.kernel_layout("value"), 64, None,
            layer.slots.sink_slots[rows], store.sink_keys[rows], store.sink_values[rows], store.tail_keys[rows],
            store.tail_values[rows], key_rotation=key_rotation if in_kernel else None,
            value_rotation=value_rotation if in_kernel else None, key_turns=turns if in_kernel else None,
        )
        return (stored if in_kernel else codec.from_basis(stored, "value")) + plain

    everything = slice(None)
    torch.testing.assert_close(attend(everything, True), attend(everything, False), atol=1e-5, rtol=1e-5)
    assert torch.equal(attend(everything, True)[1:2], attend(slice(1, 2), True))


def test_a_prefill_chunks_rows_are_rotated_by_pytorch_not_the_kernel(monkeypatch):
    """More query rows per KV head than `KERNEL_ROTATION_ROWS` (a prefill chunk): the codec rotates and turns them
    (BLAS), not the kernel's loop over each; the output is the PyTorch path's either way."""
    g = torch.Generator().manual_seed(2)
    cache = make_cache("int2", SMOLLM2_SHAPES)
    states = torch.randn(1, 3, 160 + 128, 64, generator=g)
    cache.update(states, states.flip(-1), 0, {"position_ids": torch.arange(160 + 128)[None]})
    layer = cache.layers[0]
    asked = []
    original = type(layer.codec).kernel_rotations
    monkeypatch.setattr(type(layer.codec), "kernel_rotations",
                        lambda self, *args: asked.append(True) or original(self, *args))
    for q_len, rotated_by_kernel in ((store_attention.KERNEL_ROTATION_ROWS // 3, True),
                                     (store_attention.KERNEL_ROTATION_ROWS // 3 + 1, False)):
        asked.clear()
        query = torch.randn(1, 9, q_len, 64, generator=g)
        got = attend_store(layer, query, None, 0.125, backend="cpu")
        assert bool(asked) == rotated_by_kernel
        torch.testing.assert_close(got, attend_store(layer, query, None, 0.125, backend="torch"), atol=1e-5, rtol=1e-5)


def test_a_fully_masked_row_gives_empty_partials():
    codec = CODECS["int4 keys per token"]
    states = torch.randn(1, 1, 64, 32)
    bias = torch.full((1, 1, 1, 64), float("-inf"))
    got_max, got_sum, got_acc = cpu_decode.decode_attention_partials(
        torch.randn(1, 1, 2, 1, 32), codec.encode(states, "key"), codec.encode(states, "value"),
        codec.kernel_layout("key"), codec.kernel_layout("value"), 32, bias, None,
    )
    assert (got_max == float("-inf")).all() and (got_sum == 0).all() and (got_acc == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["int4 keys per channel", "int2 per token, Lloyd-Max levels", "fp8"])
def test_whole_attention_equals_softmax_over_store_sinks_and_tail(name, dtype):
    """`decode_attention` against one softmax over [decoded store | exact sinks | tail]: a sink outside the store
    (none, or one still in the tail) weighs nothing, a sink reads its slot's bias column and the tail the columns
    after the store, and a fully masked row gives zeros."""
    codec = CODECS[name]
    g = torch.Generator().manual_seed(3)
    batch, heads, rows, tokens, tail, dim = 3, 2, 3, 96, 5, 32
    keys = torch.randn(batch, heads, tokens, dim, generator=g) * 2
    values = torch.randn(batch, heads, tokens, dim, generator=g)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    sink_k, sink_v, tail_k, tail_v = (torch.randn(batch, heads, n, dim, generator=g).to(dtype)
                                      for n in (2, 2, tail, tail))
    slots = torch.tensor([[[3, -1], [40, tokens + 1]], [[0, 95], [-1, -1]], [[7, 8], [9, 10]]])
    query = torch.randn(batch, heads, rows, dim, generator=g) * 0.3
    bias = torch.zeros(batch, 1, 1, tokens + tail)
    bias[0, :, :, :50] = float("-inf")  # hides the sink at slot 3 and the first tokens, not the one at 40
    bias[1, :, :, -2:] = -2.0  # the tail's last two
    bias[2] = float("-inf")  # a fully masked row
    stored, plain = cpu_decode.decode_attention(
        query[:, :, :, None], query, enc_k, enc_v, codec.kernel_layout("key"), codec.kernel_layout("value"), dim,
        bias, slots, sink_k, sink_v, tail_k, tail_v,
    )
    # The reference: the sinks' slots hidden in the store, the sinks appended with their slots' bias (or hidden).
    store_logits = query @ codec.decode(enc_k, "key", torch.float32).transpose(-1, -2) + bias[..., :tokens]
    inside = (slots >= 0) & (slots < tokens)
    hide = torch.zeros(batch, heads, tokens + 1, dtype=torch.bool).scatter_(2, torch.where(inside, slots, tokens), True)
    store_logits = store_logits.masked_fill(hide[:, :, None, :tokens], float("-inf"))
    sink_bias = bias.expand(batch, heads, 1, -1).gather(3, slots.clamp(min=0)[:, :, None])
    sink_logits = (query @ sink_k.float().transpose(-1, -2) + sink_bias).masked_fill(~inside[:, :, None], float("-inf"))
    tail_logits = query @ tail_k.float().transpose(-1, -2) + bias[..., tokens:]
    probs = torch.softmax(torch.cat([store_logits, sink_logits, tail_logits], -1), -1).nan_to_num(0.0)
    expected = probs[..., :tokens] @ codec.decode(enc_v, "value", torch.float32)
    expected_plain = probs[..., tokens:] @ torch.cat([sink_v, tail_v], 2).float()
    torch.testing.assert_close(stored, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, expected_plain, atol=1e-5, rtol=1e-5)
    assert (stored[2] == 0).all() and (plain[2] == 0).all()
    # the cases the slots name weigh nothing: no sinks (row 1, head 1), a sink still in the tail (row 0, head 1)
    assert (probs[1, 1, :, tokens:tokens + 2] == 0).all() and (probs[0, 1, :, tokens + 1] == 0).all()
    assert (probs[1, 0, :, tokens:tokens + 2] > 0).all()  # the store's first and last slots are sinks


@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_every_float8_byte_reads_as_the_pytorch_path_reads_it(build, vectorised):
    """Row b of the batch sees only token b, whose every key and value is byte b: the output is that byte's value,
    and so is the logit (the row's max) of a query that is 1 in one channel and 0 elsewhere; on each build's paths."""
    from hf_kvcompress.codecs.fp8 import e4m3_as_float

    tokens = rows = 256
    byte = torch.arange(256, dtype=torch.uint8)[None, None, :, None].expand(rows, 1, tokens, 32).contiguous()
    values = {"values": byte.view(torch.float8_e4m3fn), "scale": torch.ones(rows, 1, tokens, 1, dtype=torch.float16)}
    keys = {"values": byte.view(torch.float8_e4m3fn), "scale": values["scale"]}
    bias = torch.full((rows, 1, 1, tokens), float("-inf"))
    bias[torch.arange(rows), 0, 0, torch.arange(rows)] = 0.0
    layout = Fp8Codec().kernel_layout("value")
    query = torch.zeros(rows, 1, 1, 1, 32)
    query[..., 5] = 1.0  # channel 5: byte 1 of a token's second 32-bit word
    args = [query, *cpu_decode._arguments(keys, layout), *cpu_decode._arguments(values, layout), 32, bias, None]
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    if vectorised and extension.instruction_set() != "portable":
        assert list(extension.vector_paths(*args[1:5], *args[8:12], 32, 32, 1)) == [True, True]
    best, total, acc = extension.decode_attention_partials(*args, vectorised)
    # Token b of row b: [256, 1, 32].
    expected, factor = e4m3_as_float(byte[0].transpose(0, 1).view(torch.float8_e4m3fn))
    assert (total == 1).all()
    assert torch.equal(acc[:, :, 0], expected * factor)  # NaN bytes read as +-480 on every path
    assert torch.equal(best[:, 0, 0, 0], expected[:, 0, 5] * factor)


KV_HEADS, GROUPS, DIM = 2, 3, 32
CONFIG = LlamaConfig(hidden_size=KV_HEADS * GROUPS * DIM, num_attention_heads=KV_HEADS * GROUPS,
                     num_key_value_heads=KV_HEADS, head_dim=DIM, num_hidden_layers=1, intermediate_size=64,
                     vocab_size=64)
LAYER_SPECS = [
    "int4:residual_length=8,group_size=8",  # the plain name: Hadamard, 4 exact sinks, keys per channel
    "int2:residual_length=4,group_size=8",  # the plain name: pre_rope keys (a query per offset), Lloyd-Max values
    "int4:residual_length=8,group_size=8,key_axis=token",
    "int2:residual_length=4,group_size=8,key_axis=token,pre_rope=false",
    "int8:residual_length=0", "fp8:sink_tokens=2",
    "sink_window:sink_tokens=2,window=60+int4:residual_length=4,group_size=8",  # evicted slots, keys per token
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", LAYER_SPECS)
def test_a_layer_through_the_kernel_equals_the_pytorch_path(spec, dtype):
    """Rotated stores, exact sinks, a left-padded row, GQA, the tail, one and three query rows per head."""
    _kernel_against_pytorch(spec, dtype, CONFIG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["sink_window:sink_tokens=2,window=60+int4:residual_length=4,group_size=8",
                                  "int4:residual_length=8,group_size=8,key_axis=token,rotate=per_token"])
def test_scaled_keys_through_the_kernel_equal_the_pytorch_path(spec, dtype, tmp_path):
    """key_scale: the kernel reads the stored (divided) keys with the query the codec multiplied by the scales."""
    config = copy.deepcopy(CONFIG)
    path = write_key_scales(tmp_path, config)
    cache = _kernel_against_pytorch(f"{spec},key_scale={path}", dtype, config)
    assert cache.layers[0].codec.layer_key_scale is not None


def _kernel_against_pytorch(spec, dtype, config):
    g = torch.Generator().manual_seed(0)
    cache = make_cache(spec, config)
    module = type("M", (), {"layer_idx": 0, "num_key_value_groups": GROUPS, "is_causal": True})()
    tokens = 90
    padded_row = torch.cat([torch.ones(11, dtype=torch.long), torch.arange(1, tokens - 10)])
    positions = torch.stack([padded_row, torch.arange(tokens)])
    pads = torch.tensor([11, 0])
    states = (torch.randn(2, KV_HEADS, tokens, DIM, generator=g) * 2).to(dtype)
    k, v = cache.update(states, states.flip(-1), 0, kwargs := {"position_ids": positions})
    real = torch.arange(tokens) >= pads[:, None, None, None]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None] & real
    prompt_q = torch.randn(2, KV_HEADS * GROUPS, tokens, DIM, generator=g).to(dtype)
    kvcompress_attention(module, prompt_q, k, v, causal, scaling=0.2, **kwargs)
    layer = cache.layers[0]
    compared = 0
    for step in range(3):
        kwargs = {"position_ids": positions[:, -1:] + 1 + step}
        new = torch.randn(2, KV_HEADS, 1, DIM, generator=g).to(dtype)
        k, v = cache.update(new, -new, 0, kwargs)
        mask = (torch.arange(k.shape[-2]) >= layer.pads[:, None])[:, None, None, :]
        if layer.offers.request.fused:
            # fp8 encodes each step's tokens on arrival (codecs/fp8.py), so its tail is empty; every other codec
            # here has one for the kernel to cover
            assert layer.n_encoded > 0 and (layer.tail_keys.shape[-2] > 0) != layer.codec.encodes_on_arrival
            assert (layer.sink_slots is not None) == ("sink" in spec or spec.startswith(("int4:", "int2:")))
            # the kernel reads the store in place (views of the room's used slots, caches/encoded_room.py): an
            # encoding it could not read as it is would be copied whole at every step
            stored = [*layer.store.encoded_keys.values(), *layer.store.encoded_values.values()]
            assert all(_read_in_place(tensor) for tensor in stored)
            for rows in (1, 3):  # three query rows: a causal mask over the last rows of the store
                query = torch.randn(2, KV_HEADS * GROUPS, rows, DIM, generator=g).to(dtype)
                rows_mask = mask & torch.ones(rows, k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - rows - 20)
                assert store_kernel(layer, query, "auto") == "cpu"
                reference = attend_store(layer, query, rows_mask, 0.2, backend="torch")
                got = attend_store(layer, query, rows_mask, 0.2, backend="cpu")
                tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
                torch.testing.assert_close(got.float(), reference.float(), **tolerance)
                compared += 1
        query = torch.randn(2, KV_HEADS * GROUPS, 1, DIM, generator=g).to(dtype)
        kvcompress_attention(module, query, k, v, mask, scaling=0.2, **kwargs)
    assert compared == 6
    return cache


def _read_in_place(tensor: torch.Tensor) -> bool:
    """Whether the kernel reads `tensor` (a store's codes, scales or float8 values) without copying it."""
    raw = tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor
    return cpu_decode.in_rows(raw) is raw


def _filled_layer(spec):
    """A layer holding 40 random tokens of 2 KV heads, and a decode query of 6 heads."""
    cache = make_cache(spec)
    states = torch.randn(1, 2, 40, 32)
    cache.update(states, states, 0, {"position_ids": torch.arange(40)[None]})
    return cache.layers[0], torch.randn(1, 6, 1, 32)


def test_the_kernel_declines_what_it_cannot_read():
    layer, query = _filled_layer("int4:residual_length=4,group_size=8,codebook=gaussian,key_axis=token")  # 16 levels
    assert store_kernel(layer, query, "auto") is None
    with pytest.raises(ValueError, match="backend='cpu'"):
        store_kernel(layer, query, "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        store_kernel(layer, query, "cuda")


def test_without_a_compiler_the_kernel_warns_once_and_attention_stays_in_pytorch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there: it must compile
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_decode._extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not cpu_decode.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # asked again: no second build, no second warning
            assert not cpu_decode.available()
        layer, query = _filled_layer("int4:residual_length=4,group_size=8,key_axis=token")
        assert store_kernel(layer, query, "auto") is None
        with pytest.raises(RuntimeError, match="could not be built"):
            store_kernel(layer, query, "cpu")
    finally:
        cpu_decode._extension.cache_clear()


@pytest.mark.parametrize("spec", ["int4", "int2"])
def test_generate_on_the_embedded_model_gives_the_pytorch_paths_tokens(embedded, spec, monkeypatch):
    from hf_kvcompress.generation import generate

    model, tokenizer = embedded
    text = "A key and a value vector are stored for every past token in every layer of the model. " * 8
    ids = tokenizer(text + "Summarise this in one sentence:", return_tensors="pt").input_ids
    tokens = {}
    for backend in ("torch", "cpu"):
        forced = functools.partial(store_attention.attend_store, backend=backend)
        monkeypatch.setattr(layer_module, "attend_store", forced)  # what `CompressedLayer.attend` calls
        cache = make_cache(spec, model.config)
        tokens[backend] = generate(model, ids, None, cache, max_new_tokens=12).new_tokens
        assert cache.layers[0].offers.confirmed and cache.layers[0].n_encoded >= 32
    assert torch.equal(tokens["cpu"], tokens["torch"])


def _bytes(encoded: dict) -> dict:
    """float8 tensors as their bytes (CPU kernels lack float8 cat); `cpu_decode._arguments` reads them so."""
    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for n, t in encoded.items()}


def _cut(encoded: dict, tokens: int) -> dict:
    return {n: t[:, :, :tokens] for n, t in encoded.items()}


SPAN_CODECS = {  # the codecs a per-head store holds: one encoded entry per token (caches/head_store.py)
    "int4 per token": IntNCodec(bits=4, group_size=32, key_axis="token"),
    "int2 per token, Lloyd-Max levels": IntNCodec(bits=2, group_size=16, key_axis="token", codebook="gaussian"),
    "int8 per token": IntNCodec(bits=8, group_size=16, key_axis="token"),
    "fp8": Fp8Codec(),
}


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("name", SPAN_CODECS)
def test_spans_read_ragged_rows_as_the_padded_store_with_its_empty_slots_masked(name, dim, vectorised, build):
    """`spans`: each (row, head) reads its own tokens of a flat store where they lie (a per-head store's pairs),
    right-aligned in the most any row holds: the same output as the padded store [B, H, M, ...] whose empty slots
    the bias hides, read by the portable loops (rows that hold nothing, a partial tile, several tiles; the tail's
    bias columns after the M slots)."""
    codec = SPAN_CODECS[name]
    if dim % getattr(codec, "group_size", 1):
        pytest.skip("the group does not divide this head_dim")
    extension = _avx2_build() if build == "avx2" else cpu_decode._extension()
    g = torch.Generator().manual_seed(dim)
    lengths = [[70, 0, 131], [5, 64, 200]]
    batch, heads, most, tail, rows = 2, 3, 200, 3, 3
    states = [[torch.randn(1, 1, max(n, 1), dim, generator=g) * 2 for n in row] for row in lengths]  # 0: cut below
    flat, padded = {}, {}
    for kind in ("key", "value"):
        encoded = [[_cut(_bytes(codec.encode(s if kind == "key" else s.flip(-1), kind)), count)
                    for s, count in zip(row, counts, strict=True)] for row, counts in zip(states, lengths, strict=True)]
        empty = _bytes(codec.encode(torch.zeros(1, 1, 1, dim), kind))
        flat[kind] = {n: torch.cat([e[n] for row in encoded for e in row], 2) for n in empty}
        padded[kind] = {n: torch.cat([torch.cat([
            torch.cat([empty[n].expand(1, 1, most - e[n].shape[2], *empty[n].shape[3:]), e[n]], 2) for e in row
        ], 1) for row in encoded]) for n in empty}
    counts = torch.tensor(lengths)
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view(batch, heads)
    spans = torch.stack([starts, counts], -1)
    held = torch.arange(most) >= (most - counts)[..., None]  # [B, H, M]
    tail_k, tail_v = (torch.randn(batch, heads, tail, dim, generator=g) for _ in range(2))
    bias = torch.zeros(batch, heads, 1, most + tail)
    bias[1, :, :, -1] = -2.0
    query = torch.randn(batch, heads, rows, dim, generator=g) * 0.3
    layout_k, layout_v = codec.kernel_layout("key"), codec.kernel_layout("value")

    def attend(encoded, bias, vectorised, spans, module):
        return module.decode_attention(
            query[:, :, :, None].contiguous(), query, *cpu_decode._arguments(encoded["key"], layout_k),
            *cpu_decode._arguments(encoded["value"], layout_v), dim, bias, None, None, None, tail_k, tail_v,
            vectorised, None, None, None, spans)

    if extension.instruction_set() != "portable" and not layout_k.float8:  # int keys per token: the vector key path
        stores = [*cpu_decode._arguments(flat["key"], layout_k)[:4],
                  *cpu_decode._arguments(flat["value"], layout_v)[:4]]
        assert list(extension.vector_paths(*stores, dim, dim, 1))[0]
    masked = bias.clone()
    masked[..., :most] = masked[..., :most].masked_fill(~held[:, :, None], float("-inf"))
    expected = attend(padded, masked, False, None, cpu_decode._extension())
    got = attend(flat, bias, vectorised, spans, extension)
    for part, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(part, reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the store"):
        attend(flat, bias, vectorised, spans + torch.tensor([0, 1]), extension)
