"""Property tests (hypothesis) on bare cache layers: random shapes, bit widths, group sizes, budgets, batches,
padding and chunking, for every policy x codec. No model: states are random, so each example takes milliseconds."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_kvcompress.caches.layer import CompressedLayer  # noqa: E402
from hf_kvcompress.codecs.fp8 import Fp8Codec  # noqa: E402
from hf_kvcompress.codecs.identity import IdentityCodec  # noqa: E402
from hf_kvcompress.codecs.intn import IntNCodec  # noqa: E402
from hf_kvcompress.measure import measured_kv_bytes  # noqa: E402
from hf_kvcompress.policies.base import select_kept  # noqa: E402
from hf_kvcompress.policies.heavy_hitter import HeavyHitterPolicy  # noqa: E402
from hf_kvcompress.policies.keep_all import KeepAllPolicy  # noqa: E402
from hf_kvcompress.policies.sink_window import SinkWindowPolicy  # noqa: E402

FAST = settings(max_examples=25, deadline=None, derandomize=True)
ERROR_BOUND = {8: 0.01, 4: 0.2, 2: 0.8}  # relative round-trip error of uniform min/max quantization


@st.composite
def policies(draw):
    kind = draw(st.sampled_from(["keep_all", "sink_window", "h2o"]))
    if kind == "keep_all":
        return KeepAllPolicy()
    sinks = draw(st.integers(0, 3))
    if kind == "sink_window":
        return SinkWindowPolicy(sink_tokens=sinks, window=draw(st.integers(1, 12)))
    recent = draw(st.integers(0, 6))
    return HeavyHitterPolicy(budget=recent + sinks + draw(st.integers(1, 8)), recent=recent, sink_tokens=sinks)


@st.composite
def codecs(draw, evicts: bool):
    kind = draw(st.sampled_from(["identity", "fp8", "int"]))
    if kind == "identity":
        return IdentityCodec()
    if kind == "fp8":
        return Fp8Codec()
    axis = "token" if evicts else draw(st.sampled_from(["channel", "token"]))
    return IntNCodec(bits=draw(st.sampled_from([2, 4, 8])), group_size=draw(st.sampled_from([4, 8])),
                     residual_length=draw(st.integers(0, 6)), key_axis=axis)


@FAST
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([4, 8, 16]), axis=st.sampled_from(["channel", "token"]),
       batch=st.integers(1, 3), heads=st.integers(1, 3), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_intn_round_trip_within_its_bound(bits, group, axis, batch, heads, groups, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, group * groups, 16, generator=g)
    codec = IntNCodec(bits=bits, group_size=group if axis == "channel" else min(group, 16), key_axis=axis)
    for kind in ("key", "value"):
        if kind == "value" and 16 % codec.group_size:
            continue
        encoded = codec.encode(x, kind)
        decoded = codec.decode(encoded, kind, x.dtype)
        assert ((decoded - x).norm() / x.norm()) < ERROR_BOUND[bits]
        per_token = codec.bytes_per_token(16, kind, x.dtype)
        assert sum(t.numel() * t.element_size() for t in encoded.values()) == per_token * batch * heads * x.shape[2]


@FAST
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.sampled_from([8, 16, 64])),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_fp8_round_trip_within_its_bound(shape, scale, seed):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    decoded = Fp8Codec().decode(Fp8Codec().encode(x, "key"), "key", x.dtype)
    assert ((decoded - x).abs() <= x.abs().amax(-1, keepdim=True) * 0.07 + 1e-6).all()


@FAST
@given(policy=policies().filter(lambda p: p.evicts), length=st.integers(1, 30), batch=st.integers(1, 3),
       heads=st.integers(1, 3), data=st.data())
def test_kept_indices_are_valid(policy, length, batch, heads, data):
    length = max(length, policy.budget)
    pads = torch.tensor([data.draw(st.integers(0, length)) for _ in range(batch)])
    scores = None if not policy.needs_attention else torch.rand(batch, heads, length)
    kept = select_kept(policy, scores, pads, heads, length)
    assert kept.shape == (batch, heads, policy.budget)
    assert ((kept >= 0) & (kept < length)).all()
    assert (kept[..., 1:] > kept[..., :-1]).all()  # ascending and unique
    for b in range(batch):
        real = length - int(pads[b])
        first_real = int(pads[b])
        protected = set(range(first_real, min(first_real + policy.sink_tokens, length)))
        protected |= set(range(max(length - policy.recent, first_real), length))
        for h in range(heads):
            row = set(kept[b, h].tolist())
            assert protected <= row
            assert sum(i < first_real for i in row) == max(0, policy.budget - real)  # padding only if needed


def _chunks(pads, real, heads, dim, chunk, seed, pad_value):
    """A left-padded batch cut into chunks with generate-style position ids: row b has `pads[b]` padding, then the
    same `real` tokens as every other row."""
    g = torch.Generator().manual_seed(seed)
    width = max(pads) + real
    tokens_k = torch.randn(1, heads, real, dim, generator=g)
    tokens_v = torch.randn(1, heads, real, dim, generator=g)
    keys = torch.randn(len(pads), heads, width, dim, generator=g)  # padding slots hold noise
    values = torch.randn(len(pads), heads, width, dim, generator=g)
    mask = torch.zeros(len(pads), width, dtype=torch.long)
    for b in range(len(pads)):
        start = width - real
        keys[b, :, start:], values[b, :, start:] = tokens_k[0], tokens_v[0]
        mask[b, start:] = 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, pad_value)
    return [(keys[:, :, s:s + chunk], values[:, :, s:s + chunk], positions[:, s:s + chunk])
            for s in range(0, width, chunk)]


@FAST
@given(policy=policies(), data=st.data(), batch=st.integers(1, 3), heads=st.integers(1, 2),
       real=st.integers(1, 24), chunk=st.integers(1, 9), pad_value=st.sampled_from([0, 1]), seed=st.integers(0, 99))
def test_layer_invariants_under_random_streams(policy, data, batch, heads, real, chunk, pad_value, seed):
    codec = data.draw(codecs(policy.evicts))
    pads = [data.draw(st.integers(0, 10)) for _ in range(batch)]
    layer = CompressedLayer(policy, codec)
    fed = 0
    for keys, values, positions in _chunks(pads, real, heads, 16, chunk, seed, pad_value):
        out_keys, _ = layer.update(keys, values, kwargs={"position_ids": positions})
        fed += keys.shape[2]
        if layer.awaiting_attention:
            layer.observe(torch.rand(batch, heads, out_keys.shape[2]))
        assert layer.get_seq_length() == fed
        if policy.budget is not None:
            assert layer.stored_tokens <= policy.budget
        assert (layer.pads <= layer.stored_tokens).all()
        assert measured_kv_bytes(layer) == layer.promised_bytes()
    assert layer.real_seen.tolist() == [real] * batch
    # Padding is evicted first: a row keeps padding only where it has fewer real tokens than slots.
    assert (layer.stored_tokens - layer.pads).tolist() == [min(layer.stored_tokens, real)] * batch


@FAST
@given(policy=policies(), data=st.data(), heads=st.integers(1, 2), real=st.integers(1, 24), chunk=st.integers(1, 9),
       pad_value=st.sampled_from([0, 1]), seed=st.integers(0, 99))
def test_padded_rows_equal_rows_alone(policy, data, heads, real, chunk, pad_value, seed):
    codec = data.draw(codecs(policy.evicts))
    if policy.needs_attention:
        policy = SinkWindowPolicy(sink_tokens=policy.sink_tokens, window=policy.recent + 1)  # scores come from a model
    padding = data.draw(st.integers(0, 10))
    pads = [padding - padding % codec.token_block("key"), 0]  # whole per-channel key groups (PADDING_SPLITS_GROUPS)
    batched, alone = CompressedLayer(policy, codec), CompressedLayer(policy, codec)
    chunks = _chunks(pads, real, heads, 16, chunk, seed, pad_value)
    width = max(pads) + real
    # The row alone sees the same real tokens; cut so its chunks end where the batch's chunks end.
    ends = [min(s + chunk, width) - (width - real) for s in range(0, width, chunk)]
    for (keys, values, positions), end in zip(chunks, ends, strict=True):
        out_b, val_b = batched.update(keys, values, kwargs={"position_ids": positions})
        begin = alone.seen
        if end > begin:
            row_k = keys[1:, :, keys.shape[2] - (end - begin):]
            row_v = values[1:, :, keys.shape[2] - (end - begin):]
            out_a, val_a = alone.update(row_k, row_v, kwargs={"position_ids": torch.arange(begin, end)[None]})
            n = out_a.shape[2]
            assert torch.equal(out_b[0, :, -n:], out_a[0]) and torch.equal(val_b[0, :, -n:], val_a[0])
            assert torch.equal(out_b[1, :, -n:], out_a[0])
