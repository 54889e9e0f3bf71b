"""Low rank's decode kernel reading a `lowrank+int4` store's 4-bit latent codes where they lie (ops/cpu_lowrank.h
`Codes`): each tile's latents decoded in the kernel (codes times scale plus zero, the Hadamard rotation undone) are
what codecs/intn.py's `decode` gives for the whole store, so the layer's output equals, bit for bit, the kernel's over
the latents decoded in PyTorch first (the path it replaces; tests/ops/test_cpu_lowrank.py checks that one against
float64). Per-channel and per-token groups, partial tiles, tiles across the codes and the held latents, batch rows,
padding, sinks, bf16 and float32 products, the portable loops and the instruction-set paths."""

import pytest
import torch

from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.ops import cpu_decode

if not cpu_decode.available():  # builds it once per machine (about a minute), then loads it from torch's cache
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)

HEADS, DIM, ROWS = 3, 64, 3


def _store(codec, latents, kind, spare):
    """`codec`'s encoding of latents [B, 1, T, r], its tensors as views of the first T slots of a room `spare` token
    slots longer (caches/encoded_room.py holds a store so), as a cache hands them to `attend_layer`."""
    encoded = codec.encode(latents, kind)
    viewed = {}
    for name, tensor in encoded.items():
        rows = tensor.shape[2]
        extra = spare // codec.group("key") if kind == "key" and codec.key_axis == "channel" else spare
        room = torch.zeros(*tensor.shape[:2], rows + extra, tensor.shape[3], dtype=tensor.dtype)
        room[:, :, :rows] = tensor
        viewed[name] = room[:, :, :rows]
    return viewed


def _case(batch, stored, held, rank, value_rank, codec, bf16, held_dtype, seed, sinks, padded, spare=0):
    """(output reading the codes, output reading the latents decoded in PyTorch) of one layer."""
    g = torch.Generator().manual_seed(seed)
    compute = torch.bfloat16 if bf16 else torch.float32
    keys = _store(codec, torch.randn(batch, 1, stored, rank, generator=g) * 2, "key", spare)
    values = _store(codec, torch.randn(batch, 1, stored, value_rank, generator=g), "value", spare)
    held_keys = torch.randn(batch, held, rank, generator=g).to(held_dtype)
    held_values = torch.randn(batch, held, value_rank, generator=g).to(held_dtype)
    tokens = stored + held
    basis = torch.randn(HEADS, DIM, rank, generator=g) / rank ** 0.5
    kernel_basis = (basis.to(torch.bfloat16).float() if bf16 else basis).transpose(1, 2).contiguous()
    pairs = cpu_decode.bf16_pairs(basis) if bf16 else None
    mean = torch.randn(HEADS, DIM, generator=g)
    angles = torch.rand(batch, DIM // 2, tokens, generator=g) * 50
    query = torch.randn(batch, HEADS, ROWS, DIM, generator=g)
    value_basis = torch.randn(HEADS, DIM, value_rank, generator=g) / value_rank ** 0.5
    value_mean = torch.randn(HEADS, DIM, generator=g)
    tail = (torch.randn(batch, HEADS, 2, DIM, generator=g), torch.randn(batch, HEADS, 2, DIM, generator=g))
    bias = hidden = sink_states = None
    if padded:  # row 0 left-padded by 5 slots, a few other columns masked
        bias = torch.zeros(batch, 1, 1, tokens + 2)
        bias[0, :, :, :5] = float("-inf")
        bias[:, :, :, 7::11] = float("-inf")
    if sinks:  # one sink among the codes, one among the held latents (or none there), one outside the store
        hidden = torch.tensor([1, stored + held - 1, -1]).repeat(batch, HEADS, 1)
        sink_states = (torch.randn(batch, HEADS, 3, DIM, generator=g), torch.randn(batch, HEADS, 3, DIM, generator=g))
    sink_keys, sink_values = (None, None) if sink_states is None else sink_states
    decoded_keys = torch.cat([codec.decode(keys, "key", compute)[:, 0], held_keys.to(compute)], 1)
    decoded_values = torch.cat([codec.decode(values, "value", torch.float32)[:, 0], held_values.float()], 1)
    common = (mean, angles.cos(), angles.sin(), query)
    rest = (value_basis, value_mean, bias, hidden, sink_keys, sink_values, *tail)
    layouts = (codec.plain_codes("key", rank, stored, query.device),
               codec.plain_codes("value", value_rank, stored, query.device))
    assert None not in layouts  # every case here reads the codes

    def run(vectorised):
        read = cpu_decode.lowrank_decode_attention(
            held_keys.to(compute), kernel_basis, pairs, bf16, *common, held_values.float(), *rest, vectorised,
            codes=(keys, values, *layouts))
        decoded = cpu_decode.lowrank_decode_attention(
            decoded_keys, kernel_basis, pairs, bf16, *common, decoded_values, *rest, vectorised)
        return read, decoded

    return run


CODECS = {  # int4 as a lowrank stack stores its latents (no residual: the stack's held latents are passed apart)
    "KIVI keys, groups of 32, Hadamard": dict(group_size=32, key_axis="channel", rotate="hadamard"),
    "KIVI keys, groups of 8, unrotated": dict(group_size=8, key_axis="channel", rotate="none"),
    "per-token keys, groups of 8, Hadamard": dict(group_size=8, key_axis="token", rotate="hadamard"),
    "groups of 6 (not a power of two), values rotated only": dict(group_size=6, key_axis="channel",
                                                                    rotate="per_token"),
    # Each kind its own group (key_group_size / value_group_size): the kernel takes a group per kind.
    "KIVI keys in groups of 16 tokens, values of 32, Hadamard": dict(group_size=32, key_group_size=16,
                                                                     key_axis="channel", rotate="hadamard"),
    "KIVI keys in groups of 24 tokens, values of 8, unrotated": dict(key_group_size=24, value_group_size=8,
                                                                     key_axis="channel", rotate="none"),
    "per-token keys in groups of 16, values of 8, Hadamard": dict(group_size=16, value_group_size=8,
                                                                  key_axis="token", rotate="hadamard"),
}
SHAPES = {  # batch, stored tokens, held tokens, key rank, value rank
    "SmolLM2's half, two whole tiles": (1, 64, 0, 96, 96),
    "a tile across codes and held latents, batch 2": (2, 48, 21, 80, 72),
    "ranks in part blocks of 16, more held than stored": (1, 40, 50, 40, 24),
    "many tiles, a partial last one": (2, 168, 3, 48, 48),
}


@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32 products", "bf16 products"])
@pytest.mark.parametrize("codec", list(CODECS), ids=list(CODECS))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_codes_read_in_place_equal_the_decoded_latents(shape, codec, bf16, vectorised):
    batch, stored, held, rank, value_rank = SHAPES[shape]
    int4 = IntNCodec(bits=4, residual_length=0, **CODECS[codec])
    if int4.key_axis == "channel":
        stored -= stored % int4.group("key")  # KIVI key groups are whole
    for held_dtype, sinks, padded, spare in ((torch.float32, False, False, 0), (torch.bfloat16, True, True, 48)):
        group = int4.channel_step  # ranks are whole groups (lowrank's rank step)
        run = _case(batch, stored, held, max(group, rank - rank % group), max(group, value_rank - value_rank % group),
                    int4, bf16, held_dtype, seed=stored + held, sinks=sinks, padded=padded, spare=spare)
        read, decoded = run(vectorised)
        assert read.shape == (batch, HEADS, ROWS, DIM) and torch.isfinite(read).all()
        assert torch.equal(read, decoded), (held_dtype, sinks, (read - decoded).abs().max())


def test_the_instruction_set_paths_equal_the_portable_loops():
    """The codes decoded 16 x 16 at a time in registers (`dequantise_avx512`) and by the portable loops: the same
    latents, so (over the decoded latents the two paths agree up to their sums' order) the same as the latents."""
    int4 = IntNCodec(bits=4, residual_length=0, group_size=32, key_axis="channel", rotate="hadamard")
    run = _case(2, 96, 10, 96, 64, int4, False, torch.float32, seed=3, sinks=True, padded=True)
    vector, portable = run(True)[0], run(False)[0]
    assert torch.allclose(vector, portable, rtol=1e-5, atol=1e-6 * portable.abs().max().item())


def test_what_the_codes_cannot_say_is_left_to_pytorch():
    """`plain_codes` describes only what `decode` is: 4-bit codes on the uniform grid; not Lloyd-Max levels, other
    widths, pre_rope's turns, nor a rotated store of at most 16 tokens (whose PyTorch decode multiplies by the
    rotation's matrix, rounding otherwise)."""
    device = torch.device("cpu")
    plain = IntNCodec(bits=4, group_size=8, key_axis="channel", rotate="hadamard")
    layout = plain.plain_codes("key", 32, 64, device)
    assert layout is not None and layout.per_channel and layout.group_size == 8 and layout.signs is not None
    assert plain.plain_codes("key", 32, 16, device) is None  # the matrix product's rounding
    assert IntNCodec(bits=4, group_size=8, key_axis="channel").plain_codes("key", 32, 16, device).signs is None
    assert IntNCodec(bits=8, group_size=8, key_axis="channel").plain_codes("key", 32, 64, device) is None
    assert IntNCodec(bits=2, group_size=8, key_axis="channel").plain_codes("value", 32, 64, device) is None
    gaussian = IntNCodec(bits=4, group_size=8, key_axis="channel", codebook="gaussian")
    assert gaussian.plain_codes("value", 32, 64, device) is None  # Lloyd-Max levels for per-token groups
    assert gaussian.plain_codes("key", 32, 64, device) is not None  # KIVI key groups keep the uniform grid
    turned = IntNCodec(bits=4, group_size=8, key_axis="channel", pre_rope=True)
    assert turned.plain_codes("key", 32, 64, device) is None and turned.plain_codes("value", 32, 64, device)


def test_bad_codes_are_refused():
    int4 = IntNCodec(bits=4, residual_length=0, group_size=8, key_axis="channel", rotate="none")
    g = torch.Generator().manual_seed(0)
    keys = int4.encode(torch.randn(1, 1, 16, 32, generator=g), "key")
    values = int4.encode(torch.randn(1, 1, 16, 24, generator=g), "value")
    key_layout, value_layout = (int4.plain_codes(kind, 32 if kind == "key" else 24, 16, torch.device("cpu"))
                                for kind in ("key", "value"))
    basis, mean = torch.randn(HEADS, 32, DIM, generator=g), torch.randn(HEADS, DIM)
    angles = torch.rand(1, DIM // 2, 16, generator=g)
    query = torch.randn(1, HEADS, ROWS, DIM, generator=g)
    tail = torch.zeros(1, HEADS, 0, DIM)

    def call(key_store, value_store, key_codes=key_layout, held=0):
        cpu_decode.lowrank_decode_attention(
            torch.zeros(1, held, 32), basis, None, False, mean, angles.cos(), angles.sin(), query,
            torch.zeros(1, held, 24), torch.randn(HEADS, DIM, 24), torch.randn(HEADS, DIM), None, None, None, None,
            tail, tail, codes=(key_store, value_store, key_codes, value_layout))

    call(keys, values)  # as given: answers
    with pytest.raises(RuntimeError, match="scale and zero must be bfloat16"):
        call({**keys, "scale": keys["scale"].float()}, values)
    with pytest.raises(RuntimeError, match="key codes must be uint8"):
        call({**keys, "codes": keys["codes"][..., :8]}, values)
    with pytest.raises(RuntimeError, match="group must be positive and divide"):
        call(keys, values, cpu_decode.AffineCodes(5, True))
    with pytest.raises(RuntimeError, match="key and value codes must hold the same tokens"):
        call(keys, {name: t[:, :, :8] for name, t in values.items()})
    with pytest.raises(RuntimeError, match="cos and sin"):  # the tables cover the codes and the held latents
        call(keys, values, held=3)
