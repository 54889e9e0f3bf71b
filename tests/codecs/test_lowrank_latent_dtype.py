"""What a float32 model's joint low-rank store holds: bf16 latents where its decode step computes in bf16 (`compute`
auto on a CPU with fast bf16 products, or bfloat16), float32 where it computes in float32; bytes exact either way,
the PyTorch fallback reading the same store as the kernel, and a saved store loaded in the form the loading side
stores (`LowRankCodec.latent_dtype`, `as_stored`)."""

import copy

import pytest
import torch

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.ops import cpu_decode
from hf_kvcompress.ops.bf16_matmul import ENV
from hf_kvcompress.persist import load_cache, save_cache
from hf_kvcompress.study import promised_bytes

from ..caches.tiny_models import fitted_joint_bases

INT4 = "int4:group_size=8,residual_length=0,key_axis=token"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return fitted_joint_bases(tmp_path_factory.mktemp)


def _prompt(batch=2, length=30, seed=1):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a padded row too
    return ids, mask


def _latent_dtypes(cache) -> set[tuple[str, torch.dtype]]:
    return {(kind, t.dtype) for layer in cache.layers
            for kind, encoded in (("key", layer.encoded_keys), ("value", layer.encoded_values))
            for t in encoded.values()}


@pytest.mark.parametrize(("compute", "fast", "stored"), [
    ("auto", "1", torch.bfloat16), ("auto", "0", torch.float32), ("bfloat16", "0", torch.bfloat16),
    ("float32", "1", torch.float32)])
def test_a_float32_store_holds_what_its_step_computes_in(fitted, monkeypatch, compute, fast, stored):
    monkeypatch.setenv(ENV, fast)  # whether this CPU multiplies bf16 fast (`compute=auto`), forced
    model, bases = fitted["llama"]
    spec = f"lowrank:ratio=0.5,bases={bases},compute={compute}"
    cache = make_cache(spec, model.config)
    ids, mask = _prompt()
    generate(model, ids, mask, cache, max_new_tokens=4)
    assert _latent_dtypes(cache) == {("key", stored), ("value", stored)}
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    # The study's estimate binds the codec to a device of the same kind, as the layer does.
    single = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[1:], cache=single)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 30, 4) == pytest.approx(single.promised_kv_bytes() - bookkeeping)


def test_bf16_latents_halve_the_latent_bytes(fitted, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, bases = fitted["llama"]
    ids, mask = _prompt()
    held = {}
    for compute in ("float32", "auto"):
        cache = make_cache(f"lowrank:ratio=0.5,bases={bases},compute={compute}", model.config)
        prefill(model, ids, mask, cache)
        held[compute] = sum(t.numel() * t.element_size() for layer in cache.layers
                            for e in (layer.encoded_keys, layer.encoded_values) for t in e.values())
        # What a bf16 model would hold: the same either way (the results count bytes in bf16).
        held[compute, "served"] = cache.promised_kv_bytes(torch.bfloat16)
    assert held["auto"] * 2 == held["float32"]
    assert held["auto", "served"] == held["float32", "served"]


def test_a_bfloat16_model_and_int4_latents_are_unchanged(fitted, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, bases = fitted["llama"]
    ids, mask = _prompt()
    codes = {}
    for compute in ("float32", "auto"):
        cache = make_cache(f"lowrank:ratio=0.5,bases={bases},compute={compute}+{INT4}", model.config)
        prefill(model, ids, mask, cache)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        codes[compute] = [layer.encoded_keys["codes"] for layer in cache.layers]
    assert all(torch.equal(a, b) for a, b in zip(codes["float32"], codes["auto"], strict=True))
    half = copy.deepcopy(model).to(torch.bfloat16)
    cache = make_cache(f"lowrank:ratio=0.5,bases={bases},compute=float32", half.config)
    prefill(half, ids, mask, cache)
    assert _latent_dtypes(cache) == {("key", torch.bfloat16), ("value", torch.bfloat16)}
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.skipif(not cpu_decode.available(), reason="the CPU kernel cannot be built here")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kernel_and_fallback_read_the_same_bf16_store(fitted, monkeypatch, family):
    """The C++ kernel and the PyTorch blocks (what a GPU or a machine without a compiler runs) read the same bf16
    latents and pick the float32 store's greedy tokens (tests/codecs/test_lowrank_attention.py bounds the logits)."""
    monkeypatch.setenv(ENV, "1")
    model, bases = fitted[family]
    ids, mask = _prompt()
    tokens = {}
    for name, compute in (("float32", "float32"), ("kernel", "auto"), ("torch", "auto")):
        if name == "torch":  # as on a machine without a compiler: lowrank's blocks are read in PyTorch
            monkeypatch.setattr(cpu_decode, "available", lambda: False)
        cache = make_cache(f"lowrank:ratio=0.5,bases={bases},compute={compute}", model.config)
        tokens[name] = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
        stored = torch.float32 if name == "float32" else torch.bfloat16
        assert _latent_dtypes(cache) == {("key", stored), ("value", stored)}
    assert torch.equal(tokens["kernel"], tokens["torch"])
    assert torch.equal(tokens["kernel"], tokens["float32"])


def test_a_saved_store_loads_in_the_form_the_loading_side_stores(fitted, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "1")
    model, bases = fitted["llama"]
    ids, mask = _prompt()
    cache = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config)
    prefill(model, ids, mask, cache)
    save_cache(cache, tmp_path / "doc.safetensors")
    question = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    full, full_mask = torch.cat([ids, question], 1), torch.cat([mask, torch.ones_like(question)], 1)
    same = load_cache(tmp_path / "doc.safetensors")
    assert _latent_dtypes(same) == {("key", torch.bfloat16), ("value", torch.bfloat16)}
    assert measured_kv_bytes(same) == same.promised_kv_bytes()
    a = generate(model, full, full_mask, copy.deepcopy(cache), max_new_tokens=6).new_tokens
    assert torch.equal(a, generate(model, full, full_mask, same, max_new_tokens=6).new_tokens)
    monkeypatch.setenv(ENV, "0")  # loaded where the step computes in float32: the latents widen once
    wide = load_cache(tmp_path / "doc.safetensors")
    assert _latent_dtypes(wide) == {("key", torch.float32), ("value", torch.float32)}
    assert measured_kv_bytes(wide) == wide.promised_kv_bytes()
    generate(model, full, full_mask, wide, max_new_tokens=6)
    assert measured_kv_bytes(wide) == wide.promised_kv_bytes()
    assert _latent_dtypes(wide) == {("key", torch.float32), ("value", torch.float32)}


def test_the_study_counts_float32_latents_on_a_gpu(fitted, monkeypatch):
    """`compute=auto` computes in float32 on a GPU (`ops.bf16_matmul`), so a float32 plan there stores float32
    latents: the study's estimate for a GPU is the compute=float32 cache's, for a CPU with fast bf16 products less."""
    monkeypatch.delenv(ENV, raising=False)
    model, bases = fitted["llama"]
    spec = f"lowrank:ratio=0.5,bases={bases}"
    wide = promised_bytes(f"{spec},compute=float32", model.config, 30, 4, device="cuda")
    assert promised_bytes(spec, model.config, 30, 4, device="cuda") == wide
    monkeypatch.setenv(ENV, "1")
    assert promised_bytes(spec, model.config, 30, 4, device="cpu") < wide
    assert promised_bytes(spec, model.config, 30, 2, device="cpu") == promised_bytes(spec, model.config, 30, 2,
                                                                                      device="cuda")
