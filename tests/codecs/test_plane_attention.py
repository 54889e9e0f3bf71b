"""Attention products read from packed codes (codecs/plane_attention.py) and fp8's fast path equal the decoded ones."""

import itertools

import pytest
import torch

from hf_kvcompress.codecs import plane_attention
from hf_kvcompress.codecs.fp8 import Fp8Codec, e4m3_as_float
from hf_kvcompress.codecs.gaussian_levels import lloyd_max_levels
from hf_kvcompress.codecs.intn import IntNCodec

DIM = 32


def _states(seed: int, tokens: int = 64) -> torch.Tensor:
    """[2, 3, tokens, DIM] whose channels differ in scale by four orders of magnitude and in offset, so every
    group (of channels or of tokens) has its own scale and zero point: mixing two up changes the products."""
    g = torch.Generator().manual_seed(seed)
    channel_scale = torch.logspace(-2, 2, DIM)[torch.randperm(DIM, generator=g)]
    offset = torch.randn(DIM, generator=g) * 3
    token_scale = torch.rand(2, 3, tokens, 1, generator=g) * 4 + 0.1
    return torch.randn(2, 3, tokens, DIM, generator=g) * channel_scale * token_scale + offset


def _swap_groups(encoded: dict, dim: int) -> dict:
    """The same encoding with the first two groups' scales exchanged along `dim` (what a mixed-up fold would read)."""
    scale = encoded["scale"].clone()
    first, second = scale.narrow(dim, 0, 1).clone(), scale.narrow(dim, 1, 1).clone()
    scale.narrow(dim, 0, 1).copy_(second)
    scale.narrow(dim, 1, 1).copy_(first)
    return {**encoded, "scale": scale}


CASES = [
    (bits, group_size, key_axis, codebook, rotate)
    for bits, group_size, key_axis, codebook, rotate in itertools.product(
        (2, 4, 8), (8, 16), ("token", "channel"), ("uniform", "gaussian"), ("none", "hadamard")
    )
    if codebook == "uniform" or bits == 2  # Gaussian levels fold at 2 bits only (see affine_levels)
]


@pytest.mark.parametrize("bits,group_size,key_axis,codebook,rotate", CASES)
def test_folded_logits_and_mix_equal_the_decoded_products(bits, group_size, key_axis, codebook, rotate):
    codec = IntNCodec(bits=bits, group_size=group_size, key_axis=key_axis, codebook=codebook, rotate=rotate)
    states = _states(bits * 100 + group_size)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(2, 3, 5, DIM, generator=g)
    probs = torch.softmax(torch.randn(2, 3, 5, states.shape[2], generator=g) * 3, dim=-1)
    for kind in ("key", "value"):
        assert codec._folded_levels(kind) is not None  # the folded path runs, not the decoding fallback
        encoded = codec.encode(states, kind)
        decoded = codec.decode_in_basis(encoded, kind, torch.float32)
        if kind == "key":
            got, reference = codec.key_logits(encoded, query), query @ decoded.transpose(-1, -2)
        else:
            got, reference = codec.mix_values(encoded, probs), probs @ decoded
        tolerance = 1e-5 * reference.abs().max()
        torch.testing.assert_close(got, reference, atol=tolerance, rtol=1e-5)
        # The test would catch a fold that takes the wrong group's scale:
        swapped = _swap_groups(encoded, dim=3)  # head_dim groups, or two channels of per-channel keys
        wrong = codec.decode_in_basis(swapped, kind, torch.float32)
        wrong = query @ wrong.transpose(-1, -2) if kind == "key" else probs @ wrong
        assert (wrong - reference).abs().max() > 100 * tolerance


def test_channel_key_groups_over_tokens_are_folded_per_token_group():
    # Per-channel keys: swapping two token groups' scales must change the products the test above compares.
    codec = IntNCodec(bits=4, group_size=8, key_axis="channel")
    states = _states(7) * torch.logspace(-1, 1, 64)[None, None, :, None]  # token groups of different sizes too
    encoded = codec.encode(states, "key")
    query = torch.randn(2, 3, 4, DIM, generator=torch.Generator().manual_seed(2))
    reference = query @ codec.decode_in_basis(encoded, "key", torch.float32).transpose(-1, -2)
    tolerance = 1e-5 * reference.abs().max()
    torch.testing.assert_close(codec.key_logits(encoded, query), reference, atol=tolerance, rtol=1e-5)
    swapped = _swap_groups(encoded, dim=2)
    assert (codec.key_logits(swapped, query) - reference).abs().max() > 1e-3 * reference.abs().max()


def test_two_bit_gaussian_levels_are_affine_in_the_code_and_its_high_bit():
    levels = lloyd_max_levels(2)
    l0, a, b = plane_attention.affine_levels(levels)
    assert [l0 + a * c + b * (c >> 1) for c in range(4)] == pytest.approx(levels, abs=1e-12)
    assert plane_attention.affine_levels(None) == (0.0, 1.0, 0.0)
    assert plane_attention.affine_levels((-2.0, -0.5, 0.1, 3.0)) is None  # not of that form: decoded instead
    assert plane_attention.affine_levels(lloyd_max_levels(3)) is None


def test_three_bits_and_gaussian_four_bits_fall_back_to_decoding():
    assert IntNCodec(bits=3, key_axis="token")._folded_levels("key") is None
    assert IntNCodec(bits=4, key_axis="token", codebook="gaussian")._folded_levels("value") is None
    codec = IntNCodec(bits=3, key_axis="token")
    encoded = codec.encode(_states(3), "value")
    probs = torch.rand(2, 3, 2, 64)
    reference = probs @ codec.decode_in_basis(encoded, "value", torch.float32)
    torch.testing.assert_close(codec.mix_values(encoded, probs), reference)


def test_fp8_bit_move_is_exact_for_every_byte():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values, factor = e4m3_as_float(every)
    reference = every.float()
    finite = ~reference.isnan()
    assert torch.equal(values[finite] * factor, reference[finite])
    assert torch.equal(torch.signbit(values[finite]), torch.signbit(reference[finite]))  # -0 stays -0


def test_fp8_products_fold_the_per_token_scale():
    codec = Fp8Codec()
    states = _states(5)
    g = torch.Generator().manual_seed(3)
    query, probs = torch.randn(2, 3, 4, DIM, generator=g), torch.rand(2, 3, 4, 64, generator=g)
    for kind in ("key", "value"):
        encoded = codec.encode(states, kind)
        decoded = encoded["values"].float() * encoded["scale"].float()  # float8's own conversion: the reference
        assert torch.equal(codec.decode(encoded, kind, torch.float32), decoded)
        reference = query @ decoded.transpose(-1, -2) if kind == "key" else probs @ decoded
        got = codec.key_logits(encoded, query) if kind == "key" else codec.mix_values(encoded, probs)
        torch.testing.assert_close(got, reference, atol=1e-5 * reference.abs().max(), rtol=1e-5)


def test_pre_rope_leaves_per_token_keys_alone():
    # int2's plain name has pre_rope=true; with key_axis=token nothing is turned: the codes are read as they are.
    plain, turned = IntNCodec(bits=2, key_axis="token"), IntNCodec(bits=2, key_axis="token", pre_rope=True)
    assert turned.attends_encoded
    states = _states(9)
    assert torch.equal(turned.encode(states, "key")["codes"], plain.encode(states, "key")["codes"])
    encoded = plain.encode(states, "key")
    assert torch.equal(turned.decode(encoded, "key", torch.float32), plain.decode(encoded, "key", torch.float32))


@pytest.mark.parametrize("bits,rotate", [(2, "hadamard"), (3, "hadamard"), (4, "none"), (8, "hadamard")])
def test_pre_rope_channel_keys_meet_one_query_per_offset(bits, rotate):
    # pre_rope turns each key back by its offset in its group of tokens before storing it; the logits read from
    # the codes must equal the plain query against the fully decoded (turned forward again) keys.
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=DIM,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    codec = IntNCodec(bits=bits, group_size=8, key_axis="channel", pre_rope=True, rotate=rotate).for_model(config)
    encoded = codec.encode(_states(11), "key")
    query = torch.randn(2, 3, 4, DIM, generator=torch.Generator().manual_seed(4))
    reference = query @ codec.decode(encoded, "key", torch.float32).transpose(-1, -2)
    got = codec.key_logits(encoded, codec.to_basis(query, "key"))
    torch.testing.assert_close(got, reference, atol=1e-5 * reference.abs().max(), rtol=1e-5)
