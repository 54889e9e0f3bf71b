"""The Triton decode-attention kernel equals the PyTorch reference, run by Triton's interpreter on CPU."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")
# tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU (Triton reads it when imported): the kernel then
# runs on CPU tensors in the interpreter; with a GPU it is compiled and runs on CUDA tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("no GPU, and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

from transformers import LlamaConfig  # noqa: E402

from hf_kvcompress import make_cache  # noqa: E402
from hf_kvcompress.caches.store_attention import attend_store  # noqa: E402
from hf_kvcompress.codecs.intn import IntNCodec  # noqa: E402
from hf_kvcompress.hf.attention import kvcompress_attention  # noqa: E402
from hf_kvcompress.ops import cpu_decode, triton_decode  # noqa: E402

from ..caches.tiny_models import write_key_scales  # noqa: E402


@pytest.mark.parametrize("bits,key_axis", [(4, "channel"), (4, "token"), (2, "channel"), (2, "token"), (8, "token")])
def test_partials_equal_softmax_over_decoded_states(bits, key_axis):
    g = torch.Generator().manual_seed(bits)
    codec = IntNCodec(bits=bits, group_size=16, key_axis=key_axis, rotate="none")
    batch, heads, tokens, dim, rows = 2, 2, 96, 32, 3
    keys = torch.randn(batch, heads, tokens, dim, generator=g)
    values = torch.randn(batch, heads, tokens, dim, generator=g)
    keys, values = keys.to(DEVICE), values.to(DEVICE)
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    query = (torch.randn(batch, heads, rows, dim, generator=g) * 0.3).to(DEVICE)
    bias = torch.zeros(batch, heads, tokens, device=DEVICE)
    bias[0, :, :40] = float("-inf")  # row 0's first split (32 tokens) sees nothing: it must weigh nothing
    bias[1, 1, 50] = float("-inf")
    logits = query @ codec.decode(enc_k, "key", torch.float32).transpose(-1, -2) + bias[:, :, None]
    best = logits.amax(-1, keepdim=True)
    probs = torch.exp(logits - best)
    got_max, got_sum, got_acc = triton_decode.decode_attention_partials(
        query, enc_k, enc_v, dim, bias, block_t=16, tokens_per_split=32
    )
    tolerance = dict(atol=1e-5, rtol=1e-5) if INTERPRETED else dict(atol=2e-2, rtol=2e-2)  # GPU dots in tf32
    torch.testing.assert_close(got_max, best, **tolerance)
    torch.testing.assert_close(got_sum, probs.sum(-1, keepdim=True), **tolerance)
    torch.testing.assert_close(got_acc, probs @ codec.decode(enc_v, "value", torch.float32), **tolerance)


@pytest.mark.parametrize("per_head_bias", [False, True])
def test_one_launch_reads_store_sinks_and_tail_as_one_softmax(per_head_bias):
    """`decode_attention`: the store (its query, its basis; sink slots hidden), exact sinks (a slot in the tail or -1
    attends nowhere here) and a tail longer than one tile (the plain query), against the same softmax written out."""
    g = torch.Generator().manual_seed(5)
    codec = IntNCodec(bits=4, group_size=16, key_axis="channel", rotate="none")
    batch, heads, tokens, tail, dim, rows, sinks = 2, 2, 96, 70, 32, 3, 3
    def states(n):
        return torch.randn(batch, heads, n, dim, generator=g).to(DEVICE)
    keys, values, tail_k, tail_v, sink_k, sink_v = (states(n) for n in (tokens, tokens, tail, tail, sinks, sinks))
    enc_k, enc_v = codec.encode(keys, "key"), codec.encode(values, "value")
    stored_q = (torch.randn(batch, heads, rows, dim, generator=g) * 0.3).to(DEVICE)
    plain_q = (torch.randn(batch, heads, rows, dim, generator=g) * 0.3).to(DEVICE)
    slots = torch.tensor([[[0, 5, -1], [2, 7, tokens + 3]], [[1, 4, 9], [-1, 0, 50]]], device=DEVICE)
    bias = torch.zeros(batch, heads if per_head_bias else 1, tokens + tail, device=DEVICE)
    bias[0, :, :4] = float("-inf")  # row 0's left padding: sink slot 0 lies in it and must stay hidden
    bias[1, -1, tokens + 10] = float("-inf")  # a masked tail column (head 1 only when per head)
    full_bias = bias.expand(batch, heads, tokens + tail)
    decoded_keys = codec.decode(enc_k, "key", torch.float32)
    store_logits = stored_q @ decoded_keys.transpose(-1, -2) + full_bias[:, :, None, :tokens]
    in_store = (slots >= 0) & (slots < tokens)
    hidden = torch.zeros(batch, heads, tokens + 1, dtype=torch.bool, device=DEVICE)
    hidden.scatter_(2, torch.where(in_store, slots, tokens), True)
    store_logits = store_logits.masked_fill(hidden[:, :, None, :tokens], float("-inf"))
    sink_logits = plain_q @ sink_k.transpose(-1, -2) + full_bias.gather(2, slots.clamp(min=0))[:, :, None]
    sink_logits = sink_logits.masked_fill(~in_store[:, :, None], float("-inf"))
    tail_logits = plain_q @ tail_k.transpose(-1, -2) + full_bias[:, :, None, tokens:]
    logits = torch.cat([store_logits, sink_logits, tail_logits], dim=-1)
    best = logits.amax(-1, keepdim=True)
    probs = torch.exp(logits - best)
    stored = probs[..., :tokens] @ codec.decode(enc_v, "value", torch.float32)
    plain = probs[..., tokens:tokens + sinks] @ sink_v + probs[..., tokens + sinks:] @ tail_v
    got = triton_decode.decode_attention(stored_q, plain_q, enc_k, enc_v, dim, bias, slots, sink_k, sink_v,
                                         tail_k, tail_v, block_t=16, tokens_per_split=32)
    tolerance = dict(atol=1e-5, rtol=1e-5) if INTERPRETED else dict(atol=2e-2, rtol=2e-2)  # GPU dots in tf32
    for name, value, expected in zip(("max", "sum", "stored", "plain"), got,
                                     (best, probs.sum(-1, keepdim=True), stored, plain), strict=True):
        torch.testing.assert_close(value, expected, **tolerance, msg=name)


def test_unsupported_stores_are_declined():
    fp8 = {"values": torch.zeros(1, 1, 4, 32, dtype=torch.uint8), "scale": torch.zeros(1, 1, 4, 1)}
    assert not triton_decode.supports(fp8, fp8, 4, 32, 32)
    int3 = IntNCodec(bits=3, group_size=8).encode(torch.randn(1, 1, 8, 32), "value")
    assert not triton_decode.supports(int3, int3, 8, 32, 32)


@pytest.mark.parametrize("spec", [
    "int4:residual_length=8,group_size=8",
    "sink_window:sink_tokens=2,window=40+int2:residual_length=4,group_size=16,pre_rope=false,codebook=uniform",
])
def test_attention_through_the_kernel_equals_the_pytorch_path(spec):
    """A whole layer: Hadamard-rotated store, exact sinks, a left-padded row, the tail; backend 'triton' vs 'torch'."""
    _kernel_against_pytorch(make_cache(spec))


def test_scaled_keys_through_the_kernel_equal_the_pytorch_path(tmp_path):
    """key_scale: the kernel reads the stored (divided) keys with the query the codec multiplied by the scales."""
    config = LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    path = write_key_scales(tmp_path, config)
    cache = make_cache(f"sink_window:sink_tokens=2,window=40+int4:residual_length=4,group_size=16,key_scale={path}",
                       config)
    _kernel_against_pytorch(cache)
    assert cache.layers[0].codec.layer_key_scale is not None


def _kernel_against_pytorch(cache):
    g = torch.Generator().manual_seed(0)
    kv_heads, groups, dim, tokens = 2, 3, 32, 70
    module = type("M", (), {"layer_idx": 0, "num_key_value_groups": groups, "is_causal": True})()
    padded_row = torch.cat([torch.ones(3, dtype=torch.long), torch.arange(1, tokens - 2)])
    positions = torch.stack([padded_row, torch.arange(tokens)])
    positions = positions.to(DEVICE)
    pads = torch.tensor([3, 0], device=DEVICE)
    states = torch.randn(2, kv_heads, tokens, dim, generator=g).to(DEVICE)
    k, v = cache.update(states, states.flip(-1), 0, kwargs := {"position_ids": positions})
    arange = torch.arange(tokens, device=DEVICE)
    real = arange >= pads[:, None, None, None]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=DEVICE).tril()[None, None] & real
    query = torch.randn(2, kv_heads * groups, tokens, dim, generator=g).to(DEVICE)
    kvcompress_attention(module, query, k, v, causal, scaling=0.2, **kwargs)
    layer = cache.layers[0]
    for step in range(3):  # the first decode step only confirms our attention function; then fused steps
        kwargs = {"position_ids": positions[:, -1:] + 1 + step}
        new = torch.randn(2, kv_heads, 1, dim, generator=g).to(DEVICE)
        k, v = cache.update(new, -new, 0, kwargs)
        query = torch.randn(2, kv_heads * groups, 1, dim, generator=g).to(DEVICE)
        mask = (torch.arange(k.shape[-2], device=DEVICE) >= layer.pads[:, None])[:, None, None, :]
        if layer.offers.request.fused:
            assert layer.n_encoded > 0 and layer.sink_slots is not None
            reference = attend_store(layer, query, mask, 0.2, backend="torch")
            tolerance = dict(atol=1e-5, rtol=1e-5) if INTERPRETED else dict(atol=2e-2, rtol=2e-2)  # GPU dots in tf32
            torch.testing.assert_close(attend_store(layer, query, mask, 0.2, backend="triton"), reference, **tolerance)
        kvcompress_attention(module, query, k, v, mask, scaling=0.2, **kwargs)
    assert layer.offers.confirmed


def test_the_kernel_leaves_a_lloyd_max_codebook_to_pytorch():
    """The kernel dequantises on the uniform grid; int2's Lloyd-Max levels would decode wrongly there."""
    from hf_kvcompress.caches.store_attention import store_kernel

    cache = make_cache("int2:residual_length=4,group_size=16,pre_rope=false")  # codebook=gaussian (int2's default)
    states = torch.randn(1, 2, 40, 32).to(DEVICE)
    cache.update(states, states, 0, {"position_ids": torch.arange(40, device=DEVICE)[None]})
    layer = cache.layers[0]
    query = torch.randn(1, 6, 1, 32).to(DEVICE)
    assert store_kernel(layer, query, "auto") != "triton"
    with pytest.raises(ValueError, match="codebook='uniform'"):
        store_kernel(layer, query, "triton")


@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_a_room_view_is_read_in_place(key_axis):
    """A store whose rows lie in a room with spare slots (caches/encoded_room.py keeps its encodings so) is read by
    the rows' stride, not copied, and gives what the same store packed gives."""
    g = torch.Generator().manual_seed(11)
    codec = IntNCodec(bits=4, group_size=16, key_axis=key_axis, rotate="none")
    batch, heads, tokens, spare, dim, rows = 2, 2, 64, 32, 32, 3
    keys = torch.randn(batch, heads, tokens + spare, dim, generator=g).to(DEVICE)
    values = torch.randn(batch, heads, tokens + spare, dim, generator=g).to(DEVICE)
    full_k, full_v = codec.encode(keys, "key"), codec.encode(values, "value")
    def view(encoded):  # the first `tokens` slots of each row (scales per 16 tokens where keys group along tokens)
        return {name: part[:, :, : part.shape[2] * tokens // (tokens + spare)] for name, part in encoded.items()}
    room_k, room_v = view(full_k), view(full_v)
    assert not room_k["codes"].is_contiguous() and room_k["codes"].shape[2] == tokens
    packed_k = {name: part.contiguous() for name, part in room_k.items()}
    packed_v = {name: part.contiguous() for name, part in room_v.items()}
    codes, scale, zero = cpu_decode.packed_rows(room_k)
    assert codes.data_ptr() == room_k["codes"].data_ptr() and scale.data_ptr() == room_k["scale"].data_ptr()
    query = (torch.randn(batch, heads, rows, dim, generator=g) * 0.3).to(DEVICE)
    bias = torch.zeros(batch, heads, tokens, device=DEVICE)
    bias[1, 0, 5] = float("-inf")
    got = triton_decode.decode_attention_partials(query, room_k, room_v, dim, bias, block_t=16, tokens_per_split=32)
    want = triton_decode.decode_attention_partials(query, packed_k, packed_v, dim, bias, block_t=16,
                                                   tokens_per_split=32)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
