"""A steady decode step reads no tensor value on the host (on a GPU each read stalls the launch queue), and the
NaN/inf check that decode steps defer still fires."""

import pytest
import torch

from hf_kvcompress import make_cache
from hf_kvcompress.caches.layer import FINITE_CHECK_EVERY
from hf_kvcompress.hf.attention import kvcompress_attention
from hf_kvcompress.ops.host_syncs import HostSyncCounter

LAYERS, KV_HEADS, GROUPS, DIM = 2, 2, 2, 32


class _Module:
    def __init__(self, layer_idx):
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, GROUPS, True


def _step(cache, keys, values, positions, queries):
    """One forward pass's cache traffic: every layer's update, then our attention function over what it returns."""
    new = keys.shape[-2]
    pads = (positions == 1).sum(-1) - 1 if new > 1 else None
    for i in range(LAYERS):
        kwargs = {"position_ids": positions}
        k, v = cache.update(keys, values, i, kwargs)
        mask = None
        if new > 1:  # left padding of 2 in row 0 (our prefill's position 1), causal over the new tokens
            kv = k.shape[-2]
            causal = torch.ones(new, kv, dtype=torch.bool).tril(kv - new)[None, None]
            mask = causal & (torch.arange(kv)[None, None, None, :] >= pads[:, None, None, None])
        kvcompress_attention(_Module(i), queries, k, v, mask, scaling=DIM ** -0.5, **kwargs)


def _prefill(cache, tokens=40, generator=None):
    positions = torch.stack([torch.cat([torch.ones(2, dtype=torch.long), torch.arange(1, tokens - 1)]),
                             torch.arange(tokens)])  # row 0: two padding slots at position 1, as prefill gives them
    states = torch.randn(2, KV_HEADS, tokens, DIM, generator=generator)
    queries = torch.randn(2, KV_HEADS * GROUPS, tokens, DIM, generator=generator)
    _step(cache, states, states.flip(-1), positions, queries)
    return positions[:, -1:] + 1


@pytest.mark.parametrize("spec", [
    "dynamic", "int8:residual_length=8", "int4:residual_length=8,group_size=8",
    "int2:residual_length=8,group_size=8,pre_rope=false",
    "fp8", "sink_window:sink_tokens=2,window=16", "h2o:budget=16,recent=4", "snapkv:budget=16,window=4,recent=4",
])
def test_decode_steps_read_nothing_on_the_host(spec):
    g = torch.Generator().manual_seed(0)
    cache = make_cache(spec)
    position = _prefill(cache, generator=g)
    with torch.inference_mode():
        for step in range(40):  # crosses encoding blocks, evictions and the residual's fill
            states = torch.randn(2, KV_HEADS, 1, DIM, generator=g)
            with HostSyncCounter() as counter:
                _step(cache, states, -states, position + step, torch.randn(2, KV_HEADS * GROUPS, 1, DIM, generator=g))
            assert counter.count == 0, f"{spec}: {counter.count} host reads at decode step {step}"


def test_host_sync_counter_counts_reads():
    x = torch.arange(4)
    with HostSyncCounter() as counter:
        bool((x > 2).any())
        int(x.max())
    assert counter.count == 2


@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=8,group_size=8",
                                  "sink_window:sink_tokens=2,window=16"])
def test_a_non_finite_decode_step_is_refused_within_the_check_interval(spec):
    g = torch.Generator().manual_seed(0)
    cache = make_cache(spec)
    position = _prefill(cache, generator=g)
    bad = torch.randn(2, KV_HEADS, 1, DIM, generator=g)
    bad[1, 0, 0, 3] = float("nan")
    query = torch.randn(2, KV_HEADS * GROUPS, 1, DIM, generator=g)
    with pytest.raises(ValueError, match="NaN or inf"):
        for step in range(FINITE_CHECK_EVERY):
            _step(cache, bad if step == 0 else bad.nan_to_num(), bad.nan_to_num(), position + step, query)


def test_expected_attention_decode_steps_read_nothing_on_the_host():
    # Its layers need the RoPE frequencies, so the cache is built from a config of the shapes above.
    from .tiny_models import CONFIGS

    config = CONFIGS["llama"]()
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (LAYERS, KV_HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    cache = make_cache("expected_attention:budget=16,window=8,recent=2,decoding=evict", config)  # decode steps evict
    position = _prefill(cache, generator=g)
    with torch.inference_mode():
        for step in range(20):
            states = torch.randn(2, KV_HEADS, 1, DIM, generator=g)
            with HostSyncCounter() as counter:
                _step(cache, states, -states, position + step, torch.randn(2, KV_HEADS * GROUPS, 1, DIM, generator=g))
            assert counter.count == 0, f"{counter.count} host reads at decode step {step}"
