"""Low rank's decode step in the C++ kernel (ops/cpu_lowrank.h, `cpu_decode.lowrank_decode_attention`) against the
softmax it computes, written out in float64 PyTorch: keys rebuilt from latents, RoPE turned at each token's position,
masked, met with the exact sinks and the tail in one softmax, the values rebuilt from their latents; and a decode
token's encoding (`cpu_decode.lowrank_encode`) against `rerotate` and the projection."""

import pytest
import torch

from hf_kvcompress.ops import cpu_decode
from hf_kvcompress.ops.rerotate import rerotate

if not cpu_decode.available():  # builds it once per machine (about a minute), then loads it from torch's cache
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _case(batch, tokens, rank, value_rank, heads, dim, half, rows, dtype, seed=0, spare=3):
    g = torch.Generator().manual_seed(seed)
    # A view with a row stride `spare` entries past its rank and an offset: the store's block as `slice_encoded` cuts
    # it (an odd stride: bf16 pairs then straddle 32-bit words, read entry by entry).
    latent = torch.randn(batch, tokens + 7, rank + spare, generator=g).to(dtype)[:, 5 : tokens + 5, :rank]
    value_latent = torch.randn(batch, tokens, value_rank, generator=g).to(dtype)
    basis = torch.randn(heads, dim, rank, generator=g) / rank ** 0.5
    mean = torch.randn(heads, dim, generator=g)
    angles = torch.rand(batch, half, tokens, generator=g) * 50
    query = torch.randn(batch, heads, rows, dim, generator=g)
    return latent, basis, mean, angles.cos(), angles.sin(), query, value_latent


SHAPES = {  # batch, tokens, rank, value rank, KV heads, head_dim, rotated pairs, query rows per KV head
    "SmolLM2 at a half, one tile and a part": (1, 45, 80, 72, 3, 64, 32, 3),
    "batch 2, ranks not multiples of 8 or 2": (2, 70, 77, 37, 3, 64, 32, 3),
    "partial rotary, frequencies not a multiple of 4": (2, 33, 24, 16, 2, 32, 10, 4),
    "Gemma-3's 256 dims, one KV head, 4 rows": (1, 64, 48, 40, 1, 256, 128, 4),
    "a single token": (1, 1, 16, 8, 3, 64, 32, 3),
    "one KV head of 3 rows, value rank 21": (1, 40, 16, 21, 1, 64, 32, 3),
}


def _layer_reference(case, value_basis, value_mean, bias, hidden, sinks, tail, bf16: bool):
    """[B, H, M, Dv] in float64: the store's keys as `_reference` rebuilds them (bias columns [0, T)), the exact sinks
    at the `hidden` slots inside the store (bias column = slot) and the tail (columns T on), one softmax over all,
    the store's values rebuilt from their latents (basis times latent plus mean)."""
    latent, basis, mean, cos, sin, query, value_latent = case
    z, b = (_bf16(latent.float()), _bf16(basis)) if bf16 else (latent.double(), basis.double())
    batch, tokens, _ = latent.shape
    heads, dim, _ = basis.shape
    half = cos.shape[1]
    keys = torch.einsum("hdr,btr->bhdt", b, z) + mean.double()[None, :, :, None]
    c, s = cos.double()[:, None], sin.double()[:, None]
    k1, k2 = keys[:, :, :half], keys[:, :, half : 2 * half]
    turned = torch.cat([k1 * c - k2 * s, k2 * c + k1 * s, keys[:, :, 2 * half :]], dim=2).transpose(-1, -2)
    values = torch.einsum("hdr,btr->bhtd", value_basis.double(), value_latent.double()) \
        + value_mean.double()[None, :, None]
    rows = query.shape[2]
    q = query.double()
    store = torch.einsum("bhmd,bhtd->bhmt", q, turned)
    parts_v, parts_l = [values], [store]
    columns = [torch.arange(tokens).expand(batch, heads, tokens)]
    if sinks is not None:
        sink_keys, sink_values = sinks
        parts_l.append(torch.einsum("bhmd,bhsd->bhms", q, sink_keys.double()))
        parts_v.append(sink_values.double())
        columns.append(hidden.clamp(0, tokens - 1))
    tail_keys, tail_values = tail
    parts_l.append(torch.einsum("bhmd,bhsd->bhms", q, tail_keys.double()))
    parts_v.append(tail_values.double())
    columns.append(tokens + torch.arange(tail_keys.shape[2]).expand(batch, heads, -1))
    logits, values, column = torch.cat(parts_l, -1), torch.cat(parts_v, 2), torch.cat(columns, -1)
    if bias is not None:
        full = bias.double().expand(batch, heads, -1, -1).repeat(1, 1, rows // bias.shape[2], 1)
        logits = logits + full.gather(3, column[:, :, None].expand(-1, -1, rows, -1))
    if hidden is not None:
        for row in range(batch):
            for head in range(heads):
                for j, slot in enumerate(hidden[row, head].tolist()):
                    if 0 <= slot < tokens:
                        logits[row, head, :, slot] = float("-inf")  # attended as its exact sink
                    else:
                        logits[row, head, :, tokens + j] = float("-inf")  # no sink there
    top = logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = torch.exp(logits - top)
    total = weights.sum(-1, keepdim=True)
    return torch.einsum("bhmt,bhtd->bhmd", weights, values) / total.clamp(min=1e-300)


def _layer(case, value_basis, value_mean, bias, hidden, sinks, tail, bf16: bool, vectorised: bool):
    latent, basis, mean, cos, sin, query, value_latent = case
    kernel_basis = (basis.to(torch.bfloat16).float() if bf16 else basis).transpose(1, 2).contiguous()
    pairs = cpu_decode.bf16_pairs(basis) if bf16 else None
    sink_keys, sink_values = (None, None) if sinks is None else sinks
    return cpu_decode.lowrank_decode_attention(
        latent, kernel_basis, pairs, bf16, mean, cos, sin, query, value_latent, value_basis, value_mean, bias, hidden,
        sink_keys, sink_values, *tail, vectorised)


def _exact(batch, heads, tokens, dim, value_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tokens, dim, generator=g).to(dtype),
            torch.randn(batch, heads, tokens, value_dim, generator=g).to(dtype))


@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32 products", "bf16 products"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_layer_equals_the_softmax_written_out(shape, dtype, bf16, vectorised):
    """`lowrank_decode_attention`: the store, its exact sinks and its tail in one softmax, the values rebuilt,
    normalised, against float64; float32, bf16 and float16 latents and exact states, odd ranks, partial rotary, with
    and without sinks, a mask over every column and a tail of 0, 1 or 5 tokens."""
    batch, tokens, _, value_rank, heads, dim, _, rows = SHAPES[shape]
    case = _case(*SHAPES[shape], dtype)
    value_dim = dim // 2 if dim > 32 else dim  # values narrower than keys where the shape allows
    g = torch.Generator().manual_seed(3)
    value_basis = torch.randn(heads, value_dim, value_rank, generator=g) / value_rank ** 0.5
    value_mean = torch.randn(heads, value_dim, generator=g)
    for tail_tokens in (0, 1, 5):
        tail = _exact(batch, heads, tail_tokens, dim, value_dim, dtype, tail_tokens)
        columns = tokens + tail_tokens
        bias = torch.randn(batch, 1, 1, columns, generator=g).masked_fill(
            torch.rand(batch, 1, 1, columns, generator=g) < 0.2, float("-inf"))
        hidden = torch.randint(-2, tokens + 2, (batch, heads, 3), generator=g)
        sinks = _exact(batch, heads, 3, dim, value_dim, dtype, 7)
        for b, h, s in ((None, None, None), (bias, hidden, sinks)):
            got = _layer(case, value_basis, value_mean, b, h, s, tail, bf16, vectorised)
            want = _layer_reference(case, value_basis, value_mean, b, h, s, tail, bf16)
            assert got.shape == (batch, heads, rows, value_dim) and got.dtype == torch.float32
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), \
                (tail_tokens, b is None, (got.double() - want).abs().max())


def test_layer_rows_masked_throughout_give_zeros():
    case = _case(2, 40, 16, 8, 3, 64, 32, 3, torch.float32)
    g = torch.Generator().manual_seed(4)
    value_basis, value_mean = torch.randn(3, 64, 8, generator=g), torch.randn(3, 64, generator=g)
    tail = _exact(2, 3, 2, 64, 64, torch.float32, 5)
    bias = torch.zeros(2, 3, 1, 42)
    bias[1, 2] = float("-inf")  # row 1's third KV head sees nothing, store and tail
    bias[0, 1, :, :40] = float("-inf")  # row 0's second sees its tail only
    out = _layer(case, value_basis, value_mean, bias, None, None, tail, False, True)
    assert torch.isfinite(out).all() and not out[1, 2].any()
    want = _layer_reference(case, value_basis, value_mean, bias, None, None, tail, False)
    assert torch.allclose(out.double(), want, rtol=1e-4, atol=1e-5)


def test_layer_bad_arguments_are_refused():
    case = _case(1, 20, 16, 8, 3, 64, 32, 3, torch.float32)
    g = torch.Generator().manual_seed(5)
    value_basis, value_mean = torch.randn(3, 64, 8, generator=g), torch.randn(3, 64, generator=g)
    tail = _exact(1, 3, 1, 64, 64, torch.float32, 6)
    sinks = _exact(1, 3, 2, 64, 64, torch.float32, 6)
    with pytest.raises(RuntimeError, match="bias must be"):  # the store's columns only: the tail's are missing
        _layer(case, value_basis, value_mean, torch.zeros(1, 1, 1, 20), None, None, tail, False, True)
    with pytest.raises(RuntimeError, match="value_basis must be"):
        _layer(case, value_basis[..., :5], value_mean, None, None, None, tail, False, True)
    with pytest.raises(RuntimeError, match="sink states come with their slots"):
        _layer(case, value_basis, value_mean, None, None, sinks, tail, False, True)
    with pytest.raises(RuntimeError, match="tail_values must be"):
        _layer(case, value_basis, value_mean, None, None, None, (tail[0], tail[1][:, :, :, :10]), False, True)
    latent, basis, mean, cos, sin, query, value_latent = case
    kernel_basis = basis.transpose(1, 2).contiguous()

    def call(*store):
        cpu_decode.lowrank_decode_attention(*store, value_basis, value_mean, None, None, None, None, *tail)

    with pytest.raises(RuntimeError, match="basis must be"):  # [H, D, r] as the codec holds it, not [H, r, D]
        call(latent, basis, None, False, mean, cos, sin, query, value_latent)
    with pytest.raises(RuntimeError, match="cos and sin"):
        call(latent, kernel_basis, None, False, mean, cos[..., :10], sin[..., :10], query, value_latent)
    with pytest.raises(RuntimeError, match="value_latent"):
        call(latent, kernel_basis, None, False, mean, cos, sin, query, value_latent[:, :5])


@pytest.mark.parametrize("bf16", [False, True], ids=["float32 products", "bf16 products"])
@pytest.mark.parametrize(("rank", "spare"), [(80, 2), (24, 0), (48, 4)], ids=["3 blocks of words", "rows side by side",
                                                                             "one block"])
def test_layer_reads_bf16_rows_of_whole_words(rank, spare, bf16):
    """bf16 latents whose rows hold whole 32-bit words (even rank and row stride, as a store's room holds them) are
    read 16 tokens' rows at a time and transposed in registers (`pack_avx512`): whole tiles and a part, against
    float64 and against the portable loops."""
    batch, tokens, value_rank, heads, dim, rows = 2, 100, 40, 3, 64, 3
    case = _case(batch, tokens, rank, value_rank, heads, dim, 32, rows, torch.bfloat16, seed=rank, spare=spare)
    g = torch.Generator().manual_seed(8)
    value_basis = torch.randn(heads, dim, value_rank, generator=g) / value_rank ** 0.5
    value_mean = torch.randn(heads, dim, generator=g)
    tail = _exact(batch, heads, 1, dim, dim, torch.bfloat16, 9)
    got = _layer(case, value_basis, value_mean, None, None, None, tail, bf16, True)
    want = _layer_reference(case, value_basis, value_mean, None, None, None, tail, bf16)
    portable = _layer(case, value_basis, value_mean, None, None, None, tail, bf16, False)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert torch.allclose(got, portable, rtol=1e-4, atol=1e-5 * portable.abs().max().item())


def _encode_inputs(batch, heads, tokens, dim, half, rank, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Every fourth token of a longer tensor: strides the kernel must follow (a tail's slice is not contiguous either).
    states = (torch.randn(batch, heads, 4 * tokens, dim, generator=g) * 3).to(dtype)[:, :, ::4]
    positions = torch.randint(0, 5000, (batch, heads, tokens), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    mean = torch.randn(heads, dim, generator=g)
    encoder = torch.randn(heads, dim, rank, generator=g) / (heads * dim) ** 0.5
    return states, positions, inv_freq, mean, encoder


def _turn_back(states, positions, inv_freq):
    """The keys as codecs/lowrank.py's PyTorch path turns them back (`rerotate` by minus their positions), and the
    turn's cos and sin."""
    angles = (-positions).to(torch.float32)[..., None] * inv_freq
    return rerotate(states.float(), -positions, inv_freq), angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "dim", "half"), [(3, 64, 32), (2, 32, 10)], ids=["rotary", "partial rotary"])
def test_encode_equals_rerotate_and_reduce(dtype, heads, dim, half):
    """`lowrank_encode`: keys turned back and values as they are, the mean subtracted, projected: against float64."""
    states, positions, inv_freq, mean, encoder = _encode_inputs(2, heads, 3, dim, half, 24, dtype, heads)
    turned, cos, sin = _turn_back(states, positions, inv_freq)
    for given, table in ((turned, (cos, sin)), (states.float(), (None, None))):
        got = cpu_decode.lowrank_encode(states, *table, mean, encoder)
        flat = (given.double() - mean.double()[None, :, None]).transpose(1, 2).reshape(2, 3, heads * dim)
        want = (flat @ encoder.double().reshape(heads * dim, -1))[:, None]
        assert got.shape == (2, 1, 3, 24) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_rounds_the_turn_and_the_mean_as_pytorch_does(dtype):
    """With the identity for encoder each latent is one product by 1 plus zeros: the turned, centred states come out
    exactly as `rerotate` and the subtraction of the mean round them (no fused multiply-add in the turn)."""
    heads, dim, half = 3, 64, 32
    states, positions, inv_freq, mean, _ = _encode_inputs(1, heads, 5, dim, half, 1, dtype, 11)
    identity = torch.eye(heads * dim).reshape(heads, dim, heads * dim)
    turned, cos, sin = _turn_back(states, positions, inv_freq)
    got = cpu_decode.lowrank_encode(states, cos, sin, mean, identity)
    want = (turned - mean[None, :, None]).transpose(1, 2).reshape(1, 1, 5, heads * dim)
    assert torch.equal(got, want)


def test_encode_bad_arguments_are_refused():
    states, positions, inv_freq, mean, encoder = _encode_inputs(1, 3, 2, 64, 32, 8, torch.float32, 12)
    _, cos, sin = _turn_back(states, positions, inv_freq)
    with pytest.raises(RuntimeError, match="mean must be"):
        cpu_decode.lowrank_encode(states, cos, sin, mean[:2], encoder)
    with pytest.raises(RuntimeError, match="encoder must be"):
        cpu_decode.lowrank_encode(states, cos, sin, mean, encoder[:, :10])
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        cpu_decode.lowrank_encode(states, cos[..., :1, :], sin[..., :1, :], mean, encoder)
    with pytest.raises(RuntimeError, match="cos and sin come together"):
        cpu_decode.lowrank_encode(states, cos, None, mean, encoder)
    with pytest.raises(RuntimeError, match="states must be"):
        cpu_decode.lowrank_encode(states.double(), cos, sin, mean, encoder)


def _layer_inputs(case, seed):
    """Value basis and mean, and a 2-token tail, for `_layer` over `case`."""
    latent, basis, _, _, _, query, _ = case
    heads, dim, _ = basis.shape
    value_rank = case[6].shape[-1]
    g = torch.Generator().manual_seed(seed)
    value_basis = torch.randn(heads, dim, value_rank, generator=g) / value_rank ** 0.5
    value_mean = torch.randn(heads, dim, generator=g)
    return value_basis, value_mean, _exact(latent.shape[0], heads, 2, dim, dim, latent.dtype, seed)


def test_a_row_reads_what_it_reads_alone():
    """Batch rows are independent: each row's output equals the row run alone, bit for bit."""
    case = _case(3, 50, 40, 24, 2, 64, 32, 3, torch.float32)
    value_basis, value_mean, tail = _layer_inputs(case, 10)
    together = _layer(case, value_basis, value_mean, None, None, None, tail, True, True)
    batched = (0, 3, 4, 5, 6)  # latent, cos, sin, query, value_latent (the basis and mean are the model's)
    for row in range(3):
        alone = [t[row : row + 1] if i in batched else t for i, t in enumerate(case)]
        single = _layer(alone, value_basis, value_mean, None, None, None, tuple(t[row : row + 1] for t in tail),
                        True, True)
        assert torch.equal(together[row : row + 1], single)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_value_rows_apart_read_as_rows_side_by_side(dtype):
    """Value latents whose rows lie side by side (a store's room) or further apart mix to the same output, bit for
    bit (float16 ones are converted a tile or a row at a time, bf16 ones widened in registers either way)."""
    latent, basis, mean, cos, sin, query, value_latent = _case(2, 70, 24, 37, 3, 64, 32, 3, dtype)
    apart = torch.zeros(2, 70, 40, dtype=dtype)[:, :, :37]
    apart.copy_(value_latent)
    together_case = (latent, basis, mean, cos, sin, query, value_latent)
    value_basis, value_mean, tail = _layer_inputs(together_case, 11)
    together = _layer(together_case, value_basis, value_mean, None, None, None, tail, True, True)
    spaced = _layer((latent, basis, mean, cos, sin, query, apart), value_basis, value_mean, None, None, None, tail,
                    True, True)
    assert torch.equal(together, spaced)
