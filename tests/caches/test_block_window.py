"""Sliding layers with per-channel key groups: a window that drops whole groups, whose older tokens stay unseen.

On the tiny Gemma-3 (sliding_window 6: 5 tokens kept between steps) with key groups of 8 tokens, a sliding layer
holds 5 to 12 tokens; the up to 7 older than the window must never reach attention, by any attention path.
"""

import pytest
import torch

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.ops import cpu_decode
from hf_kvcompress.policies.block_window import BlockWindowPolicy
from hf_kvcompress.policies.sink_window import SinkWindowPolicy

from .tiny_models import tiny_model

SPEC = "int4:residual_length=0,group_size=8"  # 4 full-precision sinks, as plain int4
WINDOW = 5  # tiny Gemma-3's sliding_window - 1
BLOCK = 8


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _sliding(cache):
    return [layer for layer in cache.layers if layer.is_sliding]


def test_sliding_layers_store_channel_keys_and_hold_at_most_a_block_more_than_the_window():
    model = tiny_model("gemma3")
    cache = make_cache(SPEC, model.config)
    assert [(type(layer.policy), layer.codec.key_axis) for layer in cache.layers] == [
        (BlockWindowPolicy, "channel"), (BlockWindowPolicy, "channel"), (type(cache.policy), "channel")]
    held, ids = set(), _ids(9)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        for step in range(20):
            model(input_ids=_ids(1, seed=step + 1), cache=cache)
            for layer in _sliding(cache):
                assert WINDOW <= layer.stored_tokens <= WINDOW + BLOCK - 1
                assert layer.n_encoded % BLOCK == 0 and layer.get_mask_sizes(1)[1] == layer.seen - layer.stored_tokens
                held.add(layer.stored_tokens)
                if layer.n_encoded:  # one scale per channel and group of 8 tokens: keys grouped per channel
                    assert layer.encoded_keys["scale"].shape[2] * BLOCK == layer.n_encoded
            assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert held == set(range(WINDOW, WINDOW + BLOCK))  # every count in the bound occurs, blocks were dropped


def test_explicit_token_keys_keep_the_exact_window():
    model = tiny_model("gemma3")
    cache = make_cache("int4:residual_length=0,group_size=8,key_axis=token", model.config)
    generate(model, _ids(9), None, cache, max_new_tokens=6)
    for layer in _sliding(cache):
        assert isinstance(layer.policy, SinkWindowPolicy) and layer.codec.key_axis == "token"
        assert layer.stored_tokens == WINDOW


def _corrupt_out_of_window(cache, inside: bool = False) -> int:
    """Overwrite, in every sliding layer, the values of the tokens held beyond the window (or, `inside`, of the
    oldest token inside it) with large ones; returns how many slots were overwritten in the first layer."""
    count = 0
    for layer in _sliding(cache):
        extra = layer.stored_tokens - WINDOW
        lo, hi = (extra, extra + 1) if inside else (0, extra)
        if hi <= lo or hi > layer.n_encoded:
            continue
        layer.encoded_values["zero"][:, :, lo:hi] = 50.0  # per-token values: slots [lo, hi) only
        if layer.sink_slots is not None:
            hit = (layer.sink_slots >= lo) & (layer.sink_slots < hi)
            layer.sink_values[hit] = 50.0
        count = count or hi - lo
    return count


def _stepwise_logits(model, cache, corrupt: bool, inside: bool = False):
    logits, corrupted = [], 0
    with torch.no_grad():
        model(input_ids=_ids(11), cache=cache)
        for step in range(14):
            if corrupt:
                corrupted += _corrupt_out_of_window(cache, inside)
            logits.append(model(input_ids=_ids(1, seed=100 + step), cache=cache).logits)
    return torch.cat(logits, 1), corrupted


@pytest.mark.parametrize("attention", ["sdpa", "eager", "fused", "fused_torch"])
def test_tokens_older_than_the_window_are_invisible(attention, monkeypatch):
    """Values held beyond the window are overwritten before each step: the logits must not move. The same
    overwrite one slot later (inside the window) must move them, so the check can fail."""
    model = tiny_model("gemma3")
    if attention == "eager":
        model.set_attn_implementation("eager")
    elif attention.startswith("fused"):
        use_kvcompress_attention(model)
    if attention == "fused_torch":  # the PyTorch block loop instead of the C++ kernel
        monkeypatch.setattr(cpu_decode, "available", lambda: False)
    clean, _ = _stepwise_logits(model, make_cache(SPEC, model.config), corrupt=False)
    cache = make_cache(SPEC, model.config)
    hidden, corrupted = _stepwise_logits(model, cache, corrupt=True)
    assert corrupted > 0
    if attention.startswith("fused"):
        assert all(layer.store_confirmed for layer in cache.layers)  # decode steps read the encoded store
    assert torch.equal(hidden, clean)
    seen, corrupted = _stepwise_logits(model, make_cache(SPEC, model.config), corrupt=True, inside=True)
    assert corrupted > 0 and not torch.allclose(seen, clean)


def test_own_mask_hides_slots_beyond_the_attention_window():
    layer = CompressedLayer(BlockWindowPolicy(window=WINDOW, block=BLOCK), IntNCodec(), is_sliding=True,
                            attention_window=WINDOW + 1)
    states = torch.zeros(1, 1, 10, 32)
    layer.lazy_initialization(states, states)
    kwargs = {}
    layer._own_mask(kwargs, 3, 10)
    mask = kwargs["kvcompress_mask"].mask[0, 0]  # [3 queries at slots 7..9, 10 slots]
    for q, query_slot in enumerate(range(7, 10)):
        expected = [query_slot - WINDOW <= s <= query_slot for s in range(10)]
        assert mask[q].tolist() == expected


@pytest.mark.parametrize("position_ids", [True, False])
def test_padded_rows_equal_rows_alone_while_blocks_drop(position_ids):
    # Padding of 0, 8 and 16 slots: whole key groups, as per-channel keys need for row equivalence.
    model = use_kvcompress_attention(tiny_model("gemma3"))
    lengths = (21, 13, 5)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 21, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 21 - len(row):], mask[i, 21 - len(row):] = row, 1
    cache = make_cache(SPEC, model.config)
    if position_ids:
        batched = generate(model, ids, mask, cache, max_new_tokens=12).new_tokens
    else:  # transformers' own generate(): padding at position 0
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False)
        batched = out[:, ids.shape[1]:]
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert all(WINDOW <= layer.stored_tokens <= WINDOW + BLOCK - 1 for layer in _sliding(cache))
    for i, row in enumerate(rows):
        alone_cache = make_cache(SPEC, model.config)
        if position_ids:
            alone = generate(model, row[None], None, alone_cache, max_new_tokens=12).new_tokens
        else:
            alone = model.generate(input_ids=row[None], cache=alone_cache, max_new_tokens=12, do_sample=False)
            alone = alone[:, len(row):]
        assert torch.equal(batched[i], alone[0]), f"row {i}"


@pytest.mark.parametrize("spec", [SPEC, "int2:residual_length=4,group_size=8",
                                  "int4:residual_length=0,group_size=8,key_axis=token"])
@pytest.mark.parametrize("tokens", [4, 13, 19, 27])
def test_study_estimate_equals_the_block_windows_promise(spec, tokens):
    from hf_kvcompress.study import promised_bytes

    model = tiny_model("gemma3")
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=_ids(tokens), cache=cache)
    bookkeeping = model.config.num_hidden_layers * 2 * 8
    assert promised_bytes(spec, model.config, tokens, 4) == pytest.approx(cache.promised_kv_bytes() - bookkeeping)
