"""Low rank's fused store segment in the C++ kernel (ops/cpu_lowrank.h, `cpu_decode.lowrank_store_partials`) against
the softmax it computes, written out in float64 PyTorch: keys rebuilt from latents, RoPE turned at each token's
position, masked, and the value latents mixed by the weights."""

import pytest
import torch

from hf_kvcompress.ops import cpu_decode

if not cpu_decode.available():  # builds it once per machine (about a minute), then loads it from torch's cache
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _reference(latent, basis, mean, cos, sin, query, value_latent, bias, hidden, bf16: bool):
    """(max, sum, mix [.., rv + 1]) in float64: the keys q . RoPE(p)(B z + mu) with rotate-half over 2 * R / 2
    channels, bias added, hidden slots and nothing else left out."""
    z, b = latent.double(), basis.double()
    if bf16:
        z, b = _bf16(latent.float()), _bf16(basis)
    batch, tokens, _ = latent.shape
    heads, dim, _ = basis.shape
    half = cos.shape[1]
    keys = torch.einsum("hdr,btr->bhdt", b, z) + mean.double()[None, :, :, None]  # [B, H, D, T]
    c, s = cos.double()[:, None], sin.double()[:, None]
    k1, k2 = keys[:, :, :half], keys[:, :, half : 2 * half]
    turned = torch.cat([k1 * c - k2 * s, k2 * c + k1 * s, keys[:, :, 2 * half :]], dim=2)
    logits = torch.einsum("bhmd,bhdt->bhmt", query.double(), turned)
    rows = query.shape[2]
    if bias is not None:
        logits = logits + bias.double().repeat(1, 1, rows // bias.shape[2], 1)
    if hidden is not None:
        for row in range(batch):
            for head in range(heads):
                for slot in hidden[row, head].tolist():
                    if 0 <= slot < tokens:
                        logits[row, head, :, slot] = float("-inf")
    top = logits.amax(-1, keepdim=True)
    weights = torch.exp(logits - top.clamp(min=-1e300).nan_to_num(neginf=0.0))
    total = weights.sum(-1, keepdim=True)
    mix = torch.einsum("bhmt,btr->bhmr", weights, value_latent.double())
    return top, total, torch.cat([mix, total], dim=-1)


def _case(batch, tokens, rank, value_rank, heads, dim, half, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A view with a row stride past its rank and an offset: the store's block as `slice_encoded` cuts it.
    latent = torch.randn(batch, tokens + 7, rank + 3, generator=g).to(dtype)[:, 5 : tokens + 5, :rank]
    value_latent = torch.randn(batch, tokens, value_rank, generator=g).to(dtype)
    basis = torch.randn(heads, dim, rank, generator=g) / rank ** 0.5
    mean = torch.randn(heads, dim, generator=g)
    angles = torch.rand(batch, half, tokens, generator=g) * 50
    query = torch.randn(batch, heads, rows, dim, generator=g)
    return latent, basis, mean, angles.cos(), angles.sin(), query, value_latent


def _partials(case, bias, hidden, bf16: bool, vectorised: bool):
    latent, basis, mean, cos, sin, query, value_latent = case
    kernel_basis = (basis.to(torch.bfloat16).float() if bf16 else basis).transpose(1, 2).contiguous()
    pairs = cpu_decode.bf16_pairs(basis) if bf16 else None
    return cpu_decode.lowrank_store_partials(latent, kernel_basis, pairs, bf16, mean, cos, sin, query, value_latent,
                                             bias, hidden, vectorised)


SHAPES = {  # batch, tokens, rank, value rank, KV heads, head_dim, rotated pairs, query rows per KV head
    "SmolLM2 at a half, one tile and a part": (1, 45, 80, 72, 3, 64, 32, 3),
    "batch 2, ranks not multiples of 8 or 2": (2, 70, 77, 37, 3, 64, 32, 3),
    "partial rotary, frequencies not a multiple of 4": (2, 33, 24, 16, 2, 32, 10, 4),
    "Gemma-3's 256 dims, one KV head, 4 rows": (1, 64, 48, 40, 1, 256, 128, 4),
    "a single token": (1, 1, 16, 8, 3, 64, 32, 3),
}


@pytest.mark.parametrize("vectorised", [True, False], ids=["instruction-set paths", "portable"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32 products", "bf16 products"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_partials_equal_the_softmax_written_out(shape, dtype, bf16, vectorised):
    case = _case(*SHAPES[shape], dtype)
    batch, tokens, heads = SHAPES[shape][0], SHAPES[shape][1], SHAPES[shape][4]
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(batch, 1, 1, tokens, generator=g).masked_fill(torch.rand(batch, 1, 1, tokens, generator=g) < 0.2,
                                                                     float("-inf"))
    hidden = torch.randint(-2, tokens + 2, (batch, heads, 3), generator=g)
    for b, h in ((None, None), (bias, hidden)):
        got = _partials(case, b, h, bf16, vectorised)
        expected = _reference(*case, b, h, bf16)
        live = torch.isfinite(expected[0])
        assert torch.equal(torch.isfinite(got[0]), live)
        assert torch.allclose(got[0][live].double(), expected[0][live], rtol=1e-5, atol=1e-4)
        for part, want in zip(got[1:], expected[1:], strict=True):
            assert torch.allclose(part.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_rows_masked_throughout_give_minus_inf_and_zeros():
    case = _case(2, 40, 16, 8, 3, 64, 32, 3, torch.float32)
    bias = torch.zeros(2, 3, 1, 40)
    bias[1, 2] = float("-inf")  # row 1's third KV head sees nothing
    top, total, mix = _partials(case, bias, None, False, True)
    assert torch.isinf(top[1, 2]).all() and (top[1, 2] < 0).all()
    assert not total[1, 2].any() and not mix[1, 2].any()
    assert torch.isfinite(top[0]).all() and (total[0] > 0).all()


def test_a_row_reads_what_it_reads_alone():
    """Batch rows are independent: each row's partials equal the row run alone, bit for bit."""
    case = _case(3, 50, 40, 24, 2, 64, 32, 3, torch.float32)
    together = _partials(case, None, None, True, True)
    batched = (0, 3, 4, 5, 6)  # latent, cos, sin, query, value_latent (the basis and mean are the model's)
    for row in range(3):
        alone = _partials([t[row : row + 1] if i in batched else t for i, t in enumerate(case)], None, None, True, True)
        for part, single in zip(together, alone, strict=True):
            assert torch.equal(part[row : row + 1], single)


def test_bad_arguments_are_refused():
    latent, basis, mean, cos, sin, query, value_latent = _case(1, 20, 16, 8, 3, 64, 32, 3, torch.float32)
    kernel_basis = basis.transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match="basis must be"):
        cpu_decode.lowrank_store_partials(latent, basis, None, False, mean, cos, sin, query, value_latent, None, None)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_decode.lowrank_store_partials(latent, kernel_basis, None, False, mean, cos[..., :10], sin[..., :10],
                                          query, value_latent, None, None)
    with pytest.raises(RuntimeError, match="value_latent"):
        cpu_decode.lowrank_store_partials(latent, kernel_basis, None, False, mean, cos, sin, query,
                                          value_latent[:, :5], None, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_value_rows_apart_read_as_rows_side_by_side(dtype):
    """Value latents converted a tile at a time (rows side by side, a store's room) or a row at a time (rows further
    apart) mix to the same partials, bit for bit."""
    latent, basis, mean, cos, sin, query, value_latent = _case(2, 70, 24, 37, 3, 64, 32, 3, dtype)
    apart = torch.zeros(2, 70, 40, dtype=dtype)[:, :, :37]
    apart.copy_(value_latent)
    together = _partials((latent, basis, mean, cos, sin, query, value_latent), None, None, True, True)
    spaced = _partials((latent, basis, mean, cos, sin, query, apart), None, None, True, True)
    for a, b in zip(together, spaced, strict=True):
        assert torch.equal(a, b)

