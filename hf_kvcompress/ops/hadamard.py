"""Randomized Walsh-Hadamard rotation along the last axis: spreads outlier channels before quantization.

QuaRot (arXiv:2404.00456) and SpinQuant rotate keys and values by an orthogonal matrix so that a few large channels
no longer set every group's range; a Hadamard matrix with random signs is orthogonal, costs O(D log D) and needs no
calibration. For a head_dim that is not a power of two the rotation is block-diagonal: Hadamard blocks over the
largest powers of two that add up to D (96 = 64 + 32), so it stays orthogonal and exactly invertible.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def power_of_two_blocks(dim: int) -> tuple[int, ...]:
    """`dim` as a sum of decreasing powers of two (its binary digits): 96 -> (64, 32)."""
    if not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return tuple(1 << b for b in reversed(range(dim.bit_length())) if dim >> b & 1)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last axis (a power of two); its own inverse.

    The butterflies run on the transposed rows ([D, rows]), in place: each stage pairs whole contiguous rows instead
    of interleaved elements, which on CPU costs a quarter of the interleaved form at 1k tokens. The additions are the
    same, in the same order, so every element is bit for bit what the textbook form gives, whatever the number of rows
    (elementwise ops do not depend on the shape, unlike a matmul)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last axis must be a power of two, got {n}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, n).t().clone(memory_format=torch.contiguous_format)  # [n, rows]: always a copy (x is never
    # written; `contiguous()` would return a view of a single row)
    h = 1
    while h < n:
        pairs = rows.view(n // (2 * h), 2, h, -1)
        a, b = pairs[:, 0], pairs[:, 1]
        first = a.clone()
        a.add_(b)  # a + b
        torch.sub(first, b, out=b)  # a - b
        h *= 2
    # Back to x's row-major layout: a transposed result would hand its layout to everything computed from it
    # (elementwise ops and `cat` keep their input's strides), down to a store's codes, which the decode kernel
    # then copied whole at every step to read them contiguously.
    return rows.div_(math.sqrt(n)).t().contiguous().reshape(*lead, n)


@lru_cache(maxsize=256)
def random_signs(dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Fixed +-1 signs of length `dim` drawn from `seed` (float32, on `device`): the same seed gives the same
    rotation. Kept per device: a copy from the host at every decode step would be a blocking copy on a GPU."""
    if torch.device(device).type != "cpu":
        return random_signs(dim, seed).to(device)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


def _blockwise(x: torch.Tensor) -> torch.Tensor:
    blocks = power_of_two_blocks(x.shape[-1])
    if len(blocks) == 1:
        return fwht(x)
    return torch.cat([fwht(part) for part in torch.split(x, list(blocks), dim=-1)], dim=-1)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x @ (diag(signs) H): flip signs, then the (block-diagonal) Hadamard transform; computed in float32."""
    signs = random_signs(x.shape[-1], seed, x.device)
    return _blockwise(x.float() * signs)


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """Inverse of `rotate` (H is symmetric and orthonormal, so H^-1 = H); float32."""
    signs = random_signs(y.shape[-1], seed, y.device)
    return _blockwise(y.float()) * signs


# Tokens (the second-to-last axis) up to which `rotate_rows` multiplies by the rotation's matrix.
MATRIX_TOKENS = 16
_PRODUCT_VALUES = 1 << 22  # values of one [rows, D, D] broadcast product, at most


@lru_cache(maxsize=256)
def rotation_matrix(dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`rotate` as a [dim, dim] float32 matrix on `device`: x @ M == rotate(x, seed), and M's transpose undoes it.
    Built on the CPU once and kept per device (no copy from the host per step)."""
    if torch.device(device).type != "cpu":
        return rotation_matrix(dim, seed).to(device)
    return rotate(torch.eye(dim), seed)


def rotate_rows(x: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    """`rotate` (or `unrotate`) of x [..., T, D]. A decode step's query, attention output and new token are a few
    rows, for which the transform's 4 log2(D) small ops cost ~100 us on CPU and a product with the cached matrix
    ~7 us (equal up to rounding); on a GPU the product is 2 kernel launches instead of ~30. The product is a
    broadcast multiply and a sum, not a matmul, so each row's result does not depend on how many rows came with it
    (BLAS picks kernels by size); the choice between the two depends on T only, so a batch row is rotated exactly as
    it is alone."""
    if x.dim() < 2 or x.shape[-2] > MATRIX_TOKENS:
        return unrotate(x, seed) if inverse else rotate(x, seed)
    dim = x.shape[-1]
    matrix = rotation_matrix(dim, seed, x.device)
    matrix = matrix.T if inverse else matrix
    rows = x.float().reshape(-1, dim)
    step = max(1, _PRODUCT_VALUES // (dim * dim))  # bounds the [rows, D, D] product's memory
    if rows.shape[0] <= step:
        return (rows[:, :, None] * matrix).sum(-2).reshape(x.shape)
    out = torch.cat([(rows[i : i + step, :, None] * matrix).sum(-2) for i in range(0, rows.shape[0], step)])
    return out.reshape(x.shape)


def rotate_batch_rows(x: torch.Tensor, seed: int) -> torch.Tensor:
    """`rotate` of x [B, ..., D] as one matmul per batch row with the cached matrix: for the many rows
    of pre_rope's offset queries one product costs less than the transform's many small ops (docs/speed.md).
    BLAS may round a row differently with another number of rows, so each batch row is its own product (of the same
    shape whatever the batch size): a row is rotated within a batch exactly as it is alone."""
    if x.dim() < 2:
        return rotate(x, seed)
    matrix = rotation_matrix(x.shape[-1], seed, x.device)
    rows = x.float().reshape(x.shape[0], -1, x.shape[-1])
    return torch.stack([torch.matmul(row, matrix) for row in rows.unbind(0)]).reshape(x.shape)
