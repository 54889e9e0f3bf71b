"""A stack's storage residual held reduced (`residual_codec`): `lowrank:ratio=0.5+int4` holds int4's newest tokens as
lowrank's latents at full precision, not as whole head vectors; only lowrank's own window (`residual_length`: from a
half on 32 tokens beside such a storage, unless given) stays whole. Counted exactly (promised = measured = the
latents' shapes), read as lowrank alone reads them (a prompt within int4's residual generates what
`lowrank:ratio=0.5` generates), and moved by eviction, crop, beams and save/load."""

import copy

import pytest
import torch

from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, parse_spec, save_cache
from hf_kvcompress.caches.store_attention import attend_store
from hf_kvcompress.generation import generate
from hf_kvcompress.study import promised_bytes

from ..caches.test_sinks import _forward, _padded_prompts
from ..caches.tiny_models import fitted_joint_bases, padded_batch_against_rows_alone
from .test_lowrank_sinks import _spec, llama  # noqa: F401  # the module's fixture: tiny llama, joint bases

INT4 = "int4:residual_length=16,group_size=8"  # per-channel key groups of 8 tokens, 16 tokens of residual


def _latent_bytes(layer, index: int, tokens: int) -> int:
    """Bytes of `tokens` latents per row of a layer of `lowrank:...+int4` held at full precision, from the ranks."""
    key_rank, value_rank = layer.codec._ranks[index]
    latent = layer.store.residual_codec
    width = {kind: torch.empty((), dtype=latent.latent_dtype(layer.dtype, kind)).element_size()
             for kind in ("key", "value")}
    return layer.batch_size * tokens * (key_rank * width["key"] + value_rank * width["value"])


def test_only_the_reduction_window_is_whole():
    # int4's own residual of 128 (a ratio from a half on gives int4 a residual of 32, test_lowrank_int4_defaults.py).
    assert parse_spec("lowrank:ratio=0.5+int4:residual_length=128")[1].exact_residual == 128
    # Of which whole vectors: lowrank's own window, from a half on 32 tokens beside a storage with a residual (the
    # question's own tokens) unless given.
    assert parse_spec("lowrank:ratio=0.5+int4:residual_length=128")[1].whole_residual == 32
    assert parse_spec("lowrank:ratio=0.5,residual_length=0+int4")[1].whole_residual == 0
    assert parse_spec("lowrank:ratio=0.5+int4:residual_length=16")[1].whole_residual == 16  # at most int4's
    assert parse_spec("lowrank:ratio=0.5+fp8")[1].whole_residual == 0  # fp8 keeps no residual
    assert parse_spec("lowrank:ratio=0.25+int4")[1].whole_residual == 128
    assert parse_spec("lowrank:residual_length=16+int4")[1].whole_residual == 16
    assert parse_spec("int4")[1].whole_residual == 128 and parse_spec("int4")[1].residual_codec is None
    assert parse_spec("lowrank:ratio=0.5")[1].residual_codec is None  # nothing is encoded after the reduction
    # shared_heads keeps int4's residual whole (its stored heads lost an answer there, docs/results.md).
    assert parse_spec("shared_heads+int4")[1].whole_residual == 128
    assert parse_spec("shared_heads+int4")[1].residual_codec is None
    held = parse_spec("lowrank:ratio=0.5,residual_length=0+int4")[1].residual_codec
    assert held is not None and held.spec() == "lowrank:residual_length=0,ratio=0.5"  # the reduction, stored as is


@pytest.mark.parametrize("window", [0, 4])
def test_the_residual_is_held_as_latents_and_counted_exactly(llama, window):  # noqa: F811
    model, bases = llama
    ids, mask = _padded_prompts()  # 30 slots, row 0 left-padded by 5
    spec = _spec(bases, f"lowrank:ratio=0.5,residual_length={window},sink_tokens=0+{INT4}")
    cache = make_cache(spec, model.config)
    _forward(model, ids, mask, cache)
    for index, layer in enumerate(cache.layers):
        # 30 tokens: (30 - 16) // 8 * 8 = 8 encoded by int4, as when the tail held them whole; the rest latents
        # but lowrank's own window of whole vectors.
        assert (layer.n_encoded, layer.store.n_held, layer.store.tail_tokens) == (8, 22 - window, window)
        assert layer.store.held_keys["states"].shape == (2, 1, 22 - window, layer.codec._ranks[index][0])
        assert layer.positions.shape == (2, 1, 30)  # every KV head holds the same slots: one int32 position each
    # The held latents cost their shapes' bytes: measured, promised and the study's estimate agree.
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    # lowrank's own window over the 22 newest: the same 8 tokens encoded, the other 22 whole (the layout before).
    whole = make_cache(_spec(bases, f"lowrank:ratio=0.5,residual_length=22,sink_tokens=0+{INT4}"), model.config)
    _forward(model, ids, mask, whole)
    assert all(layer.n_encoded == 8 and layer.store.n_held == 0 for layer in whole.layers)
    saved = sum((22 - window) * layer.batch_size * layer.kv_heads * (layer.head_dim + layer.value_dim) * 4
                - _latent_bytes(layer, i, 22 - window) for i, layer in enumerate(cache.layers))  # fp32 whole vectors
    assert measured_kv_bytes(whole) - measured_kv_bytes(cache) == saved
    single = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[1:], cache=single)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 30, 4) == pytest.approx(single.promised_kv_bytes() - bookkeeping)


def test_held_tokens_join_int4_a_group_at_a_time(llama):  # noqa: F811
    model, bases = llama
    ids, mask = _padded_prompts()
    cache = make_cache(_spec(bases, f"lowrank:ratio=0.5,residual_length=0+{INT4}"), model.config)
    _forward(model, ids, mask, cache)
    step_ids, step_mask = ids[:, -1:], mask
    for step in range(10):
        step_mask = torch.cat([step_mask, step_mask[:, -1:]], 1)
        with torch.no_grad():
            model(input_ids=step_ids, cache=cache, attention_mask=step_mask)
        seen = 31 + step
        encoded = (seen - 16) // 8 * 8
        assert all((layer.n_encoded, layer.store.n_held, layer.store.tail_tokens) == (encoded, seen - encoded, 0)
                   for layer in cache.layers), step
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_within_the_residual_reads_as_the_reduction_alone(llama, dtype):  # noqa: F811
    """Nothing reaches int4 within its 128 tokens: the stack (without lowrank's own window of whole vectors) holds
    lowrank's latents, and generates what `lowrank:ratio=0.5` generates, state for state. (A float32 model whose
    step computes in bf16 stores lowrank's own latents in bf16, the stack's in float32 as int4 receives them:
    compared with float32 products here.)"""
    model, bases = llama
    model = copy.deepcopy(model).to(dtype)
    ids, mask = _padded_prompts()
    compute = ",compute=float32" if dtype == torch.float32 else ""
    stack, alone = (make_cache(_spec(bases, s), model.config)
                    for s in (f"lowrank:ratio=0.5,residual_length=0{compute}+int4:residual_length=128",
                              f"lowrank:ratio=0.5{compute}"))
    out_stack = generate(model, ids, mask, stack, max_new_tokens=8).new_tokens
    out_alone = generate(model, ids, mask, alone, max_new_tokens=8).new_tokens
    assert torch.equal(out_stack, out_alone)
    for a, b in zip(stack.layers, alone.layers, strict=True):
        assert a.n_encoded == 0 and a.store.n_held == b.n_encoded == 37
        for kind in ("key", "value"):
            assert torch.equal(a._full(kind), b._full(kind))
    # The fused decode reads the held latents as lowrank alone reads its store (its kernel, or PyTorch's blocks).
    layer_a, layer_b = stack.layers[0], alone.layers[0]
    query = torch.randn(2, 4, 1, layer_a.head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    for backend in ("auto", "torch"):
        assert torch.equal(attend_store(layer_a, query, None, 0.2, backend),
                           attend_store(layer_b, query, None, 0.2, backend))


@pytest.mark.parametrize("spec", [f"lowrank:ratio=0.5,residual_length=0+{INT4}",
                                  f"lowrank:ratio=0.5,residual_length=3+{INT4}", f"lowrank:ratio=0.5+{INT4}",
                                  f"tova:ratio=0.5+lowrank:ratio=0.5,residual_length=0+{INT4}",
                                  "tova:ratio=0.5+lowrank:ratio=0.5,residual_length=2"
                                  "+int4:residual_length=8,group_size=8,key_axis=token"])
def test_padded_rows_match_rows_alone(llama, spec):  # noqa: F811
    """Eviction folds the held latents into the tail (decoded) and reduces them again; padded rows still generate as
    alone, and the bytes stay exact."""
    model, bases = llama
    cache = padded_batch_against_rows_alone(model, _spec(bases, spec))
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    # The positions: one per slot while every head holds the same slots, per head once an eviction kept some.
    assert all(layer.positions.shape[1] == (2 if spec.startswith("tova") else 1) for layer in cache.layers)


def test_crop_beams_and_save_load(llama, tmp_path):  # noqa: F811
    model, bases = llama
    spec = _spec(bases, f"lowrank:ratio=0.5,residual_length=0+{INT4}")
    ids, mask = _padded_prompts()
    cache = make_cache(spec, model.config)
    generate(model, ids, mask, cache, max_new_tokens=4)  # 33 tokens: 16 encoded, 17 held
    layer = cache.layers[0]
    assert (layer.n_encoded, layer.store.n_held) == (16, 17)
    # Save and load: the held latents come back as they were, and decode on as before.
    path = tmp_path / "cache"
    save_cache(cache, path)
    loaded = load_cache(path, model=model)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert b.store.n_held == a.store.n_held and b.n_encoded == a.n_encoded
        for kind in ("key", "value"):
            assert torch.equal(a._full(kind), b._full(kind))
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes()
    # Beams: each row repeated, then one row per beam selected, with the held latents.
    loaded.batch_repeat_interleave(2)
    loaded.reorder_cache(torch.tensor([1, 1, 2, 3]))
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert b.store.n_held == a.store.n_held
        assert torch.equal(b._full("value")[0], a._full("value")[0])
        assert torch.equal(b._full("value")[2], a._full("value")[1])
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes()
    # Crop within the held latents, then into the tail: the slots kept read as before.
    before = [layer._full("key") for layer in cache.layers]
    cache.crop(-5)
    for layer, full in zip(cache.layers, before, strict=True):
        assert (layer.n_encoded, layer.store.n_held, layer.stored_tokens) == (16, 12, 28)
        assert torch.equal(layer._full("key"), full[:, :, :28])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma-3 (sliding-window layers) with joint bases, every component kept."""
    return fitted_joint_bases(tmp_path_factory.mktemp)["gemma3"]


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_sliding_layers_drop_and_evict_held_latents(gemma, axis):
    """On a model with sliding-window layers the window drops the oldest blocks (per-channel keys: a block window,
    `drop`) or evicts single tokens (per-token keys: an exact window, `take`) through the held latents; padded rows
    generate as alone and the bytes stay exact."""
    model, bases = gemma
    spec = _spec(bases, f"lowrank:ratio=0.5,residual_length=0+int4:residual_length=8,group_size=8,key_axis={axis}")
    cache = padded_batch_against_rows_alone(model, spec, lengths=(8, 40), max_new_tokens=10)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert any(layer.store.n_held for layer in cache.layers)
