"""`int4` stored under `lowrank:ratio=R` from a half on takes a default of its own (`LowRankCodec.storage_defaults`,
INT4_IN_STACK): a 32-token residual where the spec does not name one. The spec names it whatever its value, so it
rebuilds the same codec; a file saved before (its spec names none, built with int4's 128) loads as built; a group
that does not divide a layer's latent width is refused by name."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, parse_spec, save_cache
from hf_kvcompress.codecs.lowrank import INT4_IN_STACK
from hf_kvcompress.generation import generate
from hf_kvcompress.study import promised_bytes

from ..caches.tiny_models import fitted_joint_bases
from .lowrank_tiny import llama_with_bases, with_bases


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, joint bases dir): 2 layers, 2 KV heads, head_dim 32 (a latent width of 64)."""
    return llama_with_bases(tmp_path_factory)


def _residual(spec: str, **kwargs) -> int:
    return parse_spec(spec, **kwargs)[1].storage.residual_length


def test_the_stack_default_and_what_keeps_its_own():
    assert INT4_IN_STACK == {"residual_length": 32}
    assert _residual("lowrank:ratio=0.5+int4") == _residual("lowrank:ratio=1.0+int4") == 32
    assert parse_spec("lowrank:ratio=0.5+int4")[1].storage.group_size == 32  # int4's own group
    assert _residual("lowrank:ratio=0.5+int4:residual_length=128") == 128  # what the spec gives wins
    assert _residual("lowrank:ratio=0.5+int4:group_size=16") == 32
    # Not measured elsewhere: below a half (and the default quarter), rank=, other widths keep int4's own.
    for spec in ("lowrank:ratio=0.25+int4", "lowrank+int4", "lowrank:rank=16+int4", "lowrank:ratio=0.5+int3",
                 "lowrank:ratio=0.5+int8", "shared_heads+int4"):
        assert _residual(spec) == 128
    assert _residual("lowrank:ratio=0.5+int4", storage_defaults=False) == 128  # a saved spec's reading
    # lowrank's own whole window is still 32 (at most int4's residual): all of int4's residual is whole now.
    codec = parse_spec("lowrank:ratio=0.5+int4")[1]
    assert (codec.exact_residual, codec.whole_residual) == (32, 32)
    # A bad ratio is refused by LowRankCodec as before, not by the default's reading of it.
    with pytest.raises(ValueError, match="ratio must be a number in"):
        parse_spec("lowrank:ratio=half+int4")


@pytest.mark.parametrize("spec, written", [
    ("lowrank:ratio=0.5+int4", "lowrank:residual_length=32,ratio=0.5+int4:residual_length=32"),
    # int4's plain value is named too: without the stack's default as with it, the spec means 128.
    ("lowrank:ratio=0.5+int4:residual_length=128", "lowrank:residual_length=32,ratio=0.5+int4:residual_length=128"),
    ("lowrank:ratio=0.5+int4:group_size=64",
     "lowrank:residual_length=32,ratio=0.5+int4:residual_length=32,group_size=64"),
    ("lowrank:ratio=0.25+int4", "lowrank:ratio=0.25+int4"),
    ("shared_heads+int4", "shared_heads+int4"),
])
def test_the_spec_names_the_defaulted_field(spec, written):
    codec = parse_spec(spec)[1]
    assert codec.spec() == written
    assert parse_spec(written)[1] == codec == parse_spec(written, storage_defaults=False)[1]


def test_a_group_that_does_not_divide_the_latent_width_is_refused(llama, tmp_path_factory):
    model, bases = llama  # latent width 2 x 32 = 64
    with pytest.raises(ValueError, match=r"group_size of the storage .* latent width .* = 64\).*allowed 8, 16, 32, "
                                         r"64 \(any divisor of 64\), got 128"):
        make_cache(with_bases(bases, "lowrank:ratio=0.5+int4:group_size=128"), model.config)
    gemma, gemma_bases = fitted_joint_bases(tmp_path_factory.mktemp)["gemma3"]  # one KV head of 32: a width of 32
    with pytest.raises(ValueError, match=r"latent width .* = 32\).*allowed 8, 16, 32 .*got 64"):
        make_cache(with_bases(gemma_bases, "lowrank:ratio=0.5+int4:group_size=64"), gemma.config)
    make_cache(with_bases(gemma_bases, "lowrank:ratio=0.5+int4"), gemma.config)  # int4's own 32 fits


def _prompt(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


def test_bytes_are_exact_and_fewer(llama):
    model, bases = llama
    ids, mask = _prompt(200)
    measured = {}
    for spec in ("lowrank:ratio=0.5+int4", "lowrank:ratio=0.5+int4:residual_length=32",
                 "lowrank:ratio=0.5+int4:residual_length=128"):
        cache = make_cache(with_bases(bases, spec), model.config)
        generate(model, ids, mask, cache, max_new_tokens=2)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        measured[spec] = measured_kv_bytes(cache)
    plain, named, before = measured.values()
    assert plain == named < before
    # 200 tokens: 32 whole, the rest in per-channel key groups of 32 tokens but the unfinished one, held as latents.
    layer = make_cache(with_bases(bases, "lowrank:ratio=0.5+int4"), model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=layer)
    first = layer.layers[0]
    assert (first.n_encoded, first.store.n_held, first.store.tail_tokens) == (160, 200 - 160 - 32, 32)
    spec = with_bases(bases, "lowrank:ratio=0.5+int4")
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 200, 4) == pytest.approx(layer.promised_kv_bytes() - bookkeeping)


def test_a_file_saved_before_the_defaults_loads_as_built(llama, tmp_path):
    model, bases = llama
    ids, mask = _prompt(150)
    old = make_cache(with_bases(bases, "lowrank:ratio=0.5+int4:residual_length=128"), model.config)
    generate(model, ids, mask, old, max_new_tokens=3)
    path = tmp_path / "old"
    save_cache(old, path)
    # As the version before this wrote it: the spec names no int4 field (int4's plain 128 was meant).
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["spec"].endswith("+int4:residual_length=128")
    metadata["spec"] = metadata["spec"].replace("+int4:residual_length=128", "+int4")
    save_file(load_file(str(path)), str(path), metadata=metadata)
    loaded = load_cache(path, model=model)
    assert loaded.codec.storage.residual_length == 128
    assert measured_kv_bytes(loaded) == measured_kv_bytes(old) == loaded.promised_kv_bytes()
    for a, b in zip(old.layers, loaded.layers, strict=True):
        assert (a.n_encoded, a.store.n_held) == (b.n_encoded, b.store.n_held)
        for kind in ("key", "value"):
            assert torch.equal(a._full(kind), b._full(kind))
    more = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(input_ids=more, cache=old).logits
        after = model(input_ids=more, cache=loaded).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_a_new_file_round_trips(llama, tmp_path):
    model, bases = llama
    ids, mask = _prompt(150)
    cache = make_cache(with_bases(bases, "lowrank:ratio=0.5+int4"), model.config)
    generate(model, ids, mask, cache, max_new_tokens=3)
    save_cache(cache, tmp_path / "new")
    with safe_open(str(tmp_path / "new"), framework="pt") as handle:
        assert handle.metadata()["spec"].endswith("+int4:residual_length=32")
    loaded = load_cache(tmp_path / "new", model=model)
    assert loaded.spec == cache.spec and loaded.codec == cache.codec
    assert measured_kv_bytes(loaded) == measured_kv_bytes(cache)
