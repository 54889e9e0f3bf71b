"""lowrank's decode attention over the latents (joint bases): `key_logits` turns each rebuilt pre-RoPE key at its
position and meets the query, `mix_values` mixes the value latents and `from_basis` maps the mix to values once. The
reference is the decoded store (`decode`) met by a plain softmax: the same logits through a model, the same bytes,
DynamicCache at full rank, and the fused path is the one that runs."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.ops import cpu_decode

from ..caches.tiny_models import fitted_joint_bases, left_padded_prompts

INT4 = "int4:group_size=8,residual_length=0,key_axis=token"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """{family: (model, bases dir)}: every component kept, so ratio=1.0 is full rank."""
    return fitted_joint_bases(tmp_path_factory.mktemp)


def _run(model, cache, fused: bool, prompt=30, steps=8, batch=2, padded=False):
    """Logits of a prompt and `steps` single-token steps; `fused=False` turns the offer off in every layer, so
    each step decodes the store and attention reads it as the model's states (the reference)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, prompt + steps), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # the first row is left-padded by 7 tokens
        ids[0, :7], mask[0, :7] = 0, 0
    outs = []
    with torch.no_grad():
        for start, end in [(0, prompt)] + [(j, j + 1) for j in range(prompt, prompt + steps)]:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
            outs.append(model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], cache=cache,
                              position_ids=positions).logits)
            if start == 0 and not fused:
                for layer in cache.layers:
                    layer.offers.offered = False
    return torch.cat(outs, 1)


def _spec(bases, spec, compute="float32"):
    """`spec` reading `bases`; the keys rebuilt in `compute` ("float32" unless asked: the tests of the fused path's
    algebra compare it with the decoded store at float32's rounding, which a bf16 product would exceed)."""
    return spec.replace("lowrank:", f"lowrank:bases={bases},compute={compute},")


def _codec_calls(monkeypatch):
    """Calls of the PyTorch reads of a block (`key_logits`, `mix_values`) and layers read by the C++ kernel
    (`attend_layer` answering)."""
    calls = {"key_logits": 0, "mix_values": 0, "attend_layer": 0}
    for name in calls:
        original = getattr(LowRankCodec, name)

        def counted(self, *args, name=name, original=original, **kwargs):
            out = original(self, *args, **kwargs)
            calls[name] += out is not None
            return out

        monkeypatch.setattr(LowRankCodec, name, counted)
    return calls


def _without_kernel(monkeypatch):
    """As on a machine without a compiler: lowrank's blocks are read in PyTorch."""
    monkeypatch.setattr(cpu_decode, "available", lambda: False)


KERNEL = pytest.mark.skipif(not cpu_decode.available(), reason="the CPU kernel cannot be built here")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5", "lowrank:ratio=0.25,residual_length=4",
                                  f"lowrank:ratio=0.5+{INT4}", "sink_window:sink_tokens=2,window=24+lowrank:ratio=0.5"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kernel", [pytest.param(True, marks=KERNEL), False], ids=["kernel", "pytorch"])
def test_fused_decode_equals_the_decoded_store(fitted, family, spec, padded, kernel, monkeypatch):
    model, bases = fitted[family]
    spec = _spec(bases, spec)
    reference_cache = make_cache(spec, model.config)
    reference = _run(model, reference_cache, fused=False, padded=padded)
    if not kernel:
        _without_kernel(monkeypatch)
    calls = _codec_calls(monkeypatch)
    cache = make_cache(spec, model.config)
    fused = _run(model, cache, fused=True, padded=padded)
    layers = model.config.num_hidden_layers
    # Every decode step of every layer read latents: in one kernel call per layer, or in PyTorch.
    if kernel:
        assert calls["attend_layer"] == 8 * layers and calls["key_logits"] == calls["mix_values"] == 0
    else:
        assert calls["key_logits"] == calls["mix_values"] == 8 * layers and calls["attend_layer"] == 0
    assert all(layer.offers.confirmed for layer in cache.layers)
    assert (fused - reference).abs().max() < 1e-4
    assert measured_kv_bytes(cache) == measured_kv_bytes(reference_cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_decode_at_full_rank_equals_dynamic_cache(fitted, family):
    model, bases = fitted[family]
    cache = make_cache(f"lowrank:ratio=1.0,bases={bases},compute=float32", model.config)
    delta = (_run(model, cache, fused=True) - _run(model, DynamicCache(), fused=True)).abs().max()
    assert all(layer.offers.confirmed for layer in cache.layers) and cache.layers[-1].n_encoded == 38
    assert delta < 1e-4


def test_fused_decode_in_bfloat16_is_within_its_rounding(fitted):
    model, bases = fitted["llama"]
    spec = _spec(bases, "lowrank:ratio=0.5")
    model = model.to(torch.bfloat16)
    try:
        reference = _run(model, make_cache(spec, model.config), fused=False).float()
        fused = _run(model, make_cache(spec, model.config), fused=True).float()
    finally:
        model.to(torch.float32)
    # The reference rounds every rebuilt key and value to bf16 before attention; the fused path keeps them in
    # float32 (as the quantized stores' kernels do): a few bf16 units at logits of this size.
    assert (fused - reference).abs().max() <= 0.05 * reference.abs().max()


@KERNEL
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5",
                                  "sink_window:sink_tokens=2,window=24+lowrank:ratio=0.25,residual_length=4"])
def test_kernel_steps_equal_the_pytorch_steps(fitted, family, spec, monkeypatch):
    """The C++ kernel's layers (`attend_layer`: store, sinks and tail) against the PyTorch segments they replace: a
    padded batch of two, eviction (the sliding window) included. In float32 the same logits up to float32's rounding
    (the sums run in another order). With bf16 products both round the basis and the latents to bf16 (PyTorch's product
    also returns its keys in bf16, where the kernel keeps its float32 sums): the kernel's distance from float32 is a
    bf16 rounding's, as the PyTorch path's is, and it picks float32's greedy token wherever float32's lead is wider than
    that rounding (tests/ops/test_cpu_lowrank.py compares the kernel's bf16 products with their exact sums)."""
    model, bases = fitted[family]
    runs = {}
    for compute in ("float32", "bfloat16"):
        runs["kernel", compute] = _run(model, make_cache(_spec(bases, spec, compute), model.config), True, padded=True)
    _without_kernel(monkeypatch)
    for compute in ("float32", "bfloat16"):
        runs["torch", compute] = _run(model, make_cache(_spec(bases, spec, compute), model.config), True, padded=True)
    steps = slice(30, None)
    exact = runs["torch", "float32"][:, steps]
    assert (runs["kernel", "float32"][:, steps] - exact).abs().max() < 1e-4 * max(1.0, exact.abs().max().item())
    kernel_bf16, torch_bf16 = runs["kernel", "bfloat16"][:, steps], runs["torch", "bfloat16"][:, steps]
    rounding = (kernel_bf16 - exact).abs().max()
    assert 0 < rounding <= 2 * (torch_bf16 - exact).abs().max()
    top2 = exact.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * rounding
    assert clear.float().mean() > 0.5  # most steps are clear of the rounding: the comparison below says something
    assert torch.equal(kernel_bf16.argmax(-1)[clear], exact.argmax(-1)[clear])
    assert torch.equal(runs["kernel", "float32"][:, steps].argmax(-1), exact.argmax(-1))


@KERNEL
def test_attend_layer_answers_only_a_cpu_decode_step(fitted):
    """The kernel reads a decode step's few query rows; a prefill chunk's many rows (and a codec without joint
    bases) are left to PyTorch's products."""
    from hf_kvcompress.codecs.lowrank import KERNEL_ROWS

    model, bases = fitted["llama"]
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[1].codec
    heads, dim = codec._kv_heads, model.config.hidden_size // model.config.num_attention_heads
    g = torch.Generator().manual_seed(2)
    positions = torch.arange(40)[None, None].expand(1, heads, 40)
    keys = codec.encode(torch.randn(1, heads, 40, dim, generator=g), "key", positions=positions)
    values = codec.encode(torch.randn(1, heads, 40, dim, generator=g), "value")
    tail = torch.randn(1, heads, 1, dim, generator=g)
    few = torch.randn(1, heads, 3, dim, generator=g)
    many = torch.randn(1, heads, KERNEL_ROWS + 1, dim, generator=g)
    at = {"positions": positions}
    assert codec.attend_layer(keys, values, few, None, None, None, None, tail, tail, **at) is not None
    assert codec.attend_layer(keys, values, many, None, None, None, None, tail, tail, **at) is None


def test_key_logits_and_value_mix_equal_the_decoded_states(fitted):
    model, bases = fitted["gemma3"]
    spec = f"lowrank:ratio=0.5,bases={bases},compute=float32"
    codec = make_cache(spec, model.config).layers[2].codec  # a full-attention layer
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 1, 11, 32, generator=g), torch.randn(2, 1, 11, 32, generator=g)
    positions = torch.randint(0, 900, (2, 1, 11), generator=g)
    encoded_keys, encoded_values = codec.encode(keys, "key", positions=positions), codec.encode(values, "value")
    query, probs = torch.randn(2, 1, 3, 32, generator=g), torch.rand(2, 1, 3, 11, generator=g)
    decoded = codec.decode(encoded_keys, "key", torch.float32, positions=positions)
    expected = torch.matmul(query, decoded.transpose(-1, -2))
    assert torch.allclose(codec.key_logits(encoded_keys, query, positions=positions), expected, atol=1e-4)
    mixed = codec.from_basis(codec.mix_values(encoded_values, probs), "value")
    assert torch.allclose(mixed, torch.matmul(probs, codec.decode(encoded_values, "value", torch.float32)), atol=1e-5)
    # The value basis holds each latent and the mean's weight; from_basis of it is the decoded value.
    in_basis = codec.decode_in_basis(encoded_values, "value", torch.float32)
    assert in_basis.shape[-1] == codec._ranks[2][1] + 1
    assert torch.allclose(codec.from_basis(in_basis, "value"), codec.decode(encoded_values, "value", torch.float32),
                          atol=1e-5)
    with pytest.raises(ValueError, match="need positions"):
        codec.key_logits(encoded_keys, query)


def test_padded_rows_fused_match_rows_alone(fitted):
    from hf_kvcompress.generation import generate

    model, bases = fitted["llama"]
    spec = _spec(bases, "lowrank:ratio=0.5", compute="auto")  # the default path: bf16 keys where the CPU is fast at it
    rows, ids, mask = left_padded_prompts(seed=3, lengths=(5, 13))
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
    assert all(layer.offers.confirmed for layer in cache.layers)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0])


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5", "lowrank:ratio=0.25,residual_length=4"])
def test_fused_decode_steps_read_nothing_on_the_host(fitted, spec):
    from hf_kvcompress.ops.host_syncs import HostSyncCounter

    model, bases = fitted["llama"]
    cache = make_cache(_spec(bases, spec, compute="auto"), model.config)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 128, (2, 30 + 12), generator=g)
    with torch.no_grad():
        model(input_ids=ids[:, :30], cache=cache)
        for j in range(30, 42):  # the first step confirms the offer; the rest are steady fused steps
            with HostSyncCounter() as counter:
                model(input_ids=ids[:, j:j + 1], cache=cache)
            if j > 31:
                assert counter.count == 0, f"{counter.count} host reads at decode step {j - 30}"
    assert all(layer.offers.confirmed for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_key_rebuild_errs_far_less_than_the_bases(fitted, family):
    """Rebuilding the keys in bf16 (`compute=bfloat16`) moves a step's logits far less than the bases themselves move
    them from an exact cache: bf16 rounds each key by ~2^-9 of its size, half the dimensions drop far more."""
    model, bases = fitted[family]
    exact = _run(model, DynamicCache(), fused=True)
    single = _run(model, make_cache(_spec(bases, "lowrank:ratio=0.5"), model.config), fused=True)
    half = _run(model, make_cache(_spec(bases, "lowrank:ratio=0.5", compute="bfloat16"), model.config), fused=True)
    steps = slice(30, None)  # the decode steps (the prompt is attended exactly, before anything is stored)
    rounding = (half - single)[:, steps].abs().max()
    basis_error = (single - exact)[:, steps].abs().max()
    assert 0 < rounding < 0.01 * basis_error, (rounding, basis_error)  # 1e-4 and 1e-3 of it when written
    assert torch.equal(half[:, steps].argmax(-1), single[:, steps].argmax(-1))  # the same greedy tokens


def test_step_shares_one_turn_table_and_drops_it(fitted, monkeypatch):
    """Every layer of a step holds the same positions: the cos/sin tables are built once per step, at the first
    layer, read by the others and dropped after the last, so the cache holds nothing more between steps."""
    from hf_kvcompress.codecs.lowrank import TurnTables

    model, bases = fitted["llama"]
    layers = model.config.num_hidden_layers
    cache = make_cache(_spec(bases, "lowrank:ratio=0.5"), model.config)
    builds, reads = [], []
    original = TurnTables.lookup

    def counted(self, inv_freq, position):
        held = [entry[2] for entry in self.entries]
        cos, sin = original(self, inv_freq, position)
        (reads if any(cos is c for c in held) else builds).append(position.shape[-1])
        return cos, sin

    monkeypatch.setattr(TurnTables, "lookup", counted)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 34), generator=g)
    with torch.no_grad():
        model(input_ids=ids[:, :30], cache=cache)
        for j in range(30, 34):
            builds.clear()
            reads.clear()
            model(input_ids=ids[:, j:j + 1], cache=cache)
            assert len({id(layer.codec._turns) for layer in cache.layers}) == 1
            assert cache.layers[0].codec._turns.entries == []  # dropped by the last layer
            if j > 30:  # a steady fused step (the first confirms the offer)
                assert builds == [j] and reads == [j] * (layers - 1)  # one table of every stored slot, shared
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_turn_tables_match_positions_by_value():
    from hf_kvcompress.codecs.lowrank import TurnTables

    tables = TurnTables()
    inv_freq = torch.tensor([1.0, 0.1])
    positions = torch.arange(6, dtype=torch.float32).view(1, 1, 6)
    cos, sin = tables.lookup(inv_freq, positions)
    angles = inv_freq[:, None] * positions[:, :, None, :]
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    assert tables.lookup(inv_freq.clone(), positions.clone())[0] is cos  # equal values: the same table
    positions[0, 0, 2] = 9.0  # changed in place: the held copy no longer matches
    assert tables.lookup(inv_freq, positions)[0] is not cos
    assert tables.lookup(inv_freq * 2, positions)[0] is not cos  # other frequencies
    for shift in range(TurnTables.MAX_ENTRIES + 2):
        tables.lookup(inv_freq, positions + shift)
    assert len(tables.entries) == TurnTables.MAX_ENTRIES
    tables.release()
    assert tables.entries == []


def test_compute_must_be_a_known_dtype():
    with pytest.raises(ValueError, match="compute must be one of auto, bfloat16, float32"):
        LowRankCodec(compute="float16")


def test_bf16_key_products_keep_one_shape_as_the_store_grows(monkeypatch):
    """oneDNN compiles and keeps a primitive per bf16 product shape (~1.2 MB each): a product over all the tokens,
    whose count grows at every step, grew the process at every step. Every product has KEY_CHUNK columns instead,
    and the chunks together equal the whole product."""
    from hf_kvcompress.codecs import lowrank

    g = torch.Generator().manual_seed(4)
    basis, latent = torch.randn(48, 16, generator=g), torch.randn(2 * lowrank.KEY_CHUNK + 300, 16, generator=g)
    shapes = set()
    original = torch.mm

    def recorded(a, b):
        shapes.add((tuple(a.shape), tuple(b.shape), b.stride()))
        return original(a, b)

    monkeypatch.setattr(torch, "mm", recorded)
    for rows in (1, 7, lowrank.KEY_CHUNK, lowrank.KEY_CHUNK + 1, latent.shape[0]):
        out = lowrank._product_in_chunks(basis.bfloat16(), latent[:rows])
        assert out.dtype == torch.float32 and out.shape == (48, rows)
        exact = basis.bfloat16().float() @ latent[:rows].bfloat16().float().t()
        assert torch.allclose(out, exact, rtol=2 ** -7, atol=1e-2)  # the bf16 output's rounding, no more
    assert shapes == {((48, 16), (16, lowrank.KEY_CHUNK), (1, 16))}


@KERNEL
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_tokens_encoding_in_the_kernel_equals_pytorchs(fitted, family, dtype, monkeypatch):
    """A decode step's token is encoded in one C++ call (`_encode_in_kernel`): its latents equal the PyTorch path's
    (`rerotate` and `reduce`) up to the projection's sum order, keys and values, in every layer; a prompt's tokens
    (more than ENCODE_KERNEL_TOKENS) keep the PyTorch path."""
    model, bases = fitted[family]
    cache = make_cache(_spec(bases, "lowrank:ratio=0.5"), model.config)
    g = torch.Generator().manual_seed(6)
    for layer_idx, layer in enumerate(cache.layers):
        codec = layer.codec
        heads, dim = codec._head_shape()
        states = torch.randn(2, heads, 3, dim, generator=g).to(dtype)
        positions = torch.randint(0, 4000, (2, heads, 3), generator=g)
        kernel = {kind: codec._encode_in_kernel(states, kind, positions) for kind in ("key", "value")}
        got = {kind: codec.encode(states, kind, positions=positions) for kind in ("key", "value")}
        with monkeypatch.context() as patch:
            _without_kernel(patch)
            want = {kind: codec.encode(states, kind, positions=positions) for kind in ("key", "value")}
        for kind in ("key", "value"):
            assert kernel[kind] is not None, (layer_idx, kind)
            for name, tensor in want[kind].items():
                # bf16 latents: the two sums may round to neighbouring bf16 values
                tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
                assert torch.allclose(got[kind][name].float(), tensor.float(), rtol=tolerance, atol=tolerance), \
                    (layer_idx, kind)
    prompt = torch.randn(1, heads, 20, dim, dtype=dtype)
    assert codec._encode_in_kernel(prompt, "key", torch.arange(20).expand(1, heads, 20)) is None
