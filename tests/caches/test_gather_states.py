"""`gather_states` (rows copied by index_select) keeps exactly what `torch.gather` along the token axis keeps."""

import pytest
import torch

from hf_kvcompress.caches.storage import gather_states


def _reference(states, index):
    states = states.expand(-1, index.shape[1], -1, -1)
    return torch.gather(states, 2, index[..., None].expand(*index.shape, states.shape[-1]))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "one_head"])
def test_gather_states_equals_torch_gather(layout):
    g = torch.Generator().manual_seed(0)
    batch, heads, tokens, dim, kept = 3, 4, 9, 5, 6
    if layout == "transposed":  # a non-contiguous view: reshaped by copy, same values
        states = torch.randn(batch, tokens, heads, dim, generator=g).transpose(1, 2)
    else:
        states = torch.randn(batch, 1 if layout == "one_head" else heads, tokens, dim, generator=g)
    index = torch.stack([torch.randperm(tokens, generator=g)[:kept].sort().values for _ in range(batch * heads)])
    index = index.view(batch, heads, kept)
    got = gather_states(states, index)
    assert torch.equal(got, _reference(states, index))
    assert got.is_contiguous() and got.untyped_storage().data_ptr() != states.untyped_storage().data_ptr()
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # no evicted rows kept alive
