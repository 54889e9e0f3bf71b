"""The randomized Hadamard rotation is orthogonal, exactly invertible and seeded, for any head_dim."""

import math

import pytest
import torch

from hf_kvcompress.ops.hadamard import fwht, power_of_two_blocks, random_signs, rotate, unrotate


def _sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256])
def test_fwht_equals_the_hadamard_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ _sylvester(n).double(), atol=1e-12)


def _interleaved_fwht(x):
    """The textbook butterflies on interleaved elements, the form `fwht` computed before it ran transposed."""
    n, lead, h = x.shape[-1], x.shape[:-1], 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, n)
        h *= 2
    return x / math.sqrt(n)


@pytest.mark.parametrize("shape", [(64,), (1, 64), (3, 17, 64), (2, 3, 1000, 32), (1, 3, 5, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fwht_is_bit_for_bit_the_interleaved_form_and_leaves_its_input_alone(shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    before = x.clone()
    out = fwht(x)
    assert out.shape == x.shape and torch.equal(out, _interleaved_fwht(x))
    assert out.is_contiguous()  # a transposed layout would pass on to everything computed from it (a store's codes)
    assert torch.equal(x, before)
    # A row's result does not depend on the rows beside it (what batch rows equal to rows alone rely on).
    assert torch.equal(fwht(x.reshape(-1, shape[-1])[:1]), out.reshape(-1, shape[-1])[:1])


@pytest.mark.parametrize("dim", [64, 256, 96, 80, 72, 33])
def test_rotation_is_orthogonal_and_inverted_exactly(dim):
    matrix = rotate(torch.eye(dim), seed=3)  # row i = e_i rotated, so this is the rotation matrix
    assert torch.allclose(matrix @ matrix.T, torch.eye(dim), atol=1e-5)
    x = torch.randn(2, 3, 7, dim)
    y = rotate(x, seed=3)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(unrotate(y, seed=3), x, atol=1e-5)


def test_signs_are_fixed_by_the_seed_and_differ_between_seeds():
    assert torch.equal(random_signs(64, 1), random_signs(64, 1))
    assert not torch.equal(random_signs(64, 1), random_signs(64, 2))
    x = torch.randn(4, 64)
    assert not torch.allclose(rotate(x, 1), rotate(x, 2))


def test_rotation_spreads_an_outlier_channel():
    x = torch.randn(100, 64) * 0.1
    x[:, 5] = 50.0
    y = rotate(x, seed=0)
    # The outlier's energy is shared by every channel: the largest magnitude drops by about sqrt(64).
    assert y.abs().max() < x.abs().max() / 4


def test_non_power_of_two_dims_are_block_diagonal_over_powers_of_two():
    assert power_of_two_blocks(96) == (64, 32)
    assert power_of_two_blocks(80) == (64, 16)
    assert power_of_two_blocks(128) == (128,)
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.randn(2, 96))
    with pytest.raises(ValueError, match="dim"):
        power_of_two_blocks(0)


def test_rotating_a_few_rows_by_the_matrix_equals_the_transform():
    from hf_kvcompress.ops.hadamard import MATRIX_TOKENS, rotate_rows

    for dim in (64, 96):
        x = torch.randn(3, 4, dim)
        torch.testing.assert_close(rotate_rows(x, 7), rotate(x, 7), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(rotate_rows(rotate(x, 7), 7, inverse=True), x, atol=2e-6, rtol=1e-5)
        many = torch.randn(2, MATRIX_TOKENS + 1, dim)
        assert torch.equal(rotate_rows(many, 7), rotate(many, 7))  # the transform itself beyond MATRIX_TOKENS
        # The choice depends on the tokens only: a row is rotated the same within a batch as alone.
        batch = torch.randn(8, 3, 1, dim)
        assert torch.equal(rotate_rows(batch, 7)[2:3], rotate_rows(batch[2:3], 7))


def test_rotating_batch_rows_by_matmul_equals_the_transform_and_each_row_alone():
    from hf_kvcompress.ops.hadamard import rotate_batch_rows

    for dim in (64, 96):
        x = torch.randn(5, 3, 96, dim)
        torch.testing.assert_close(rotate_batch_rows(x, 7), rotate(x, 7), atol=2e-6, rtol=1e-5)
        for row in range(5):
            assert torch.equal(rotate_batch_rows(x, 7)[row : row + 1], rotate_batch_rows(x[row : row + 1], 7))
