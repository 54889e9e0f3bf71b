"""`all_finite`, the one-pass NaN/inf test of the cache's refusal, agrees with `isfinite().all()`."""

import pytest
import torch

from hf_kvcompress.caches.finite_check import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("shape", [(1, 3, 1, 64), (2, 3, 40, 64)])
def test_all_finite_agrees_with_isfinite(dtype, bad, shape):
    x = torch.randn(shape).to(dtype)
    if bad is not None:
        x.view(-1)[x.numel() // 3] = bad
    assert bool(all_finite(x)) == bool(x.isfinite().all()) == (bad is None)
    assert bool(all_finite(torch.zeros_like(x), x)) == bool(all_finite(x, torch.zeros_like(x))) == (bad is None)


def test_an_empty_step_is_finite():
    assert bool(all_finite(torch.empty(1, 3, 0, 64)))
