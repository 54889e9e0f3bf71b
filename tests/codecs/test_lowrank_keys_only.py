"""lowrank with `kinds=keys` (ShadowKV's split, arXiv:2410.21465): the keys projected as `kinds=both` projects them,
the values stored whole by the stack's storage (exact alone, as `int4`/`int8` store them in a stack); the ratio is a
share of the key dimensions; bytes count what is stored; eviction, padding and the C++ kernel compose with it."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, save_cache
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.codecs.lowrank import LowRankCodec, allocate_ranks, allocate_ranks_by_error
from hf_kvcompress.generation import generate
from hf_kvcompress.ops import cpu_decode
from hf_kvcompress.registry import parse_spec

from ..caches.tiny_models import (
    calibration_model,
    filled_as_the_study_counts,
    fitted_joint_bases,
    left_padded_prompts,
    prompt_then_steps,
)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """{family: (model, bases dir)}: every component kept (2 layers, 2 KV heads, head_dim 32)."""
    return fitted_joint_bases(tmp_path_factory.mktemp)


def _states(seed: int, heads: int = 2, tokens: int = 9, dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g),
            torch.arange(tokens, dtype=torch.int32)[None, None].expand(1, heads, tokens).contiguous())


@pytest.mark.parametrize("storage", ["", "+int8", "+int4:residual_length=0"])
def test_keys_equal_kinds_both_and_values_are_stored_whole(fitted, storage):
    model, bases = fitted["llama"]
    both = make_cache(f"lowrank:rank=16,bases={bases}{storage}", model.config).layers[1].codec
    keys_only = make_cache(f"lowrank:rank=16,kinds=keys,bases={bases}{storage}", model.config).layers[1].codec
    keys, values, positions = _states(5, tokens=32)  # whole per-channel key groups
    assert keys_only.layer_ranks[1] == (32, 64)  # 16 x 2 KV heads for keys; every dimension of the values
    decoded = keys_only.decode(keys_only.encode(keys, "key", positions=positions), "key", torch.float32,
                               positions=positions)
    reference = both.decode(both.encode(keys, "key", positions=positions), "key", torch.float32, positions=positions)
    torch.testing.assert_close(decoded, reference, rtol=0, atol=1e-6)
    assert (decoded - keys).abs().max() > 1e-2  # the keys are projected
    whole = keys_only.decode(keys_only.encode(values, "value"), "value", torch.float32)
    if not storage:
        assert torch.equal(whole, values)  # exact
    else:  # as the storage stores the layer's heads concatenated, one latent row per token
        plain = IntNCodec(bits=8) if storage == "+int8" else keys_only.storage
        flat = values.transpose(1, 2).reshape(1, 1, 32, 64)
        expected = plain.decode(plain.encode(flat, "value"), "value", torch.float32)
        torch.testing.assert_close(whole, expected.reshape(1, 32, 2, 32).transpose(1, 2), rtol=0, atol=0)
        assert (whole - values).abs().max() < (0.02 if storage == "+int8" else 0.5)


def test_full_key_rank_equals_dynamic_cache(fitted):
    model, bases = fitted["llama"]
    cache = make_cache(f"lowrank:ratio=1.0,kinds=keys,bases={bases},compute=float32", model.config)
    delta = (prompt_then_steps(model, cache).float() - prompt_then_steps(model, DynamicCache()).float()).abs().max()
    assert cache.layers[-1].n_encoded == 35  # every token was read back from the store
    assert delta < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5,kinds=keys",
                                  "lowrank:ratio=0.5,kinds=keys+int4:group_size=16,residual_length=2,key_axis=token",
                                  "lowrank:ratio=0.5,kinds=keys+int8:residual_length=2,key_axis=token",
                                  "h2o:budget=8,recent=2+lowrank:ratio=0.5,kinds=keys",
                                  "tova:ratio=0.5+lowrank:ratio=0.25,kinds=keys,residual_length=0+int4:group_size=16"])
def test_bytes_are_exact_and_padded_rows_match_rows_alone(fitted, family, spec):
    model, bases = fitted[family]
    spec = spec.replace("lowrank:", f"lowrank:bases={bases},")
    rows, ids, mask = left_padded_prompts(seed=3, lengths=(5, 13))
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    heads = model.config.num_key_value_heads
    for layer in cache.layers:
        assert layer.codec.layer_ranks[layer.codec._layer_idx][1] == heads * 32  # every value dimension
        if layer.n_encoded == 0:
            continue
        values = sum(t.numel() * t.element_size() for t in layer.encoded_values.values())
        # The values as the storage stores the layer's heads concatenated (KV heads x 32 dims), per token of a row.
        stored = layer.codec.storage.bytes_per_token(heads * 32, "value", torch.float32)
        assert values == 2 * layer.n_encoded * stored
        assert layer.codec.bytes_per_token(32, "value", torch.float32) == stored / heads
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["", "+int4:group_size=16,residual_length=2"])
def test_the_kernel_and_the_block_reads_generate_alike(fitted, dtype, storage, monkeypatch):
    if not cpu_decode.available():
        pytest.skip("the C++ kernel is not built")
    model, bases = fitted["llama"]
    model = model.to(dtype)
    try:
        spec = f"lowrank:ratio=0.5,kinds=keys,bases={bases},compute=float32{storage}"
        kernel = prompt_then_steps(model, make_cache(spec, model.config)).float()
        monkeypatch.setattr(cpu_decode, "available", lambda: False)
        blocks = prompt_then_steps(model, make_cache(spec, model.config)).float()
    finally:
        model.to(torch.float32)
    bound = 1e-4 if dtype == torch.float32 else 0.1
    assert (kernel - blocks).abs().max() < bound
    assert not torch.equal(kernel, blocks) or dtype == torch.bfloat16  # two paths: sums in another order


def test_float32_values_stay_float32_where_keys_are_bf16_latents(fitted):
    model, bases = fitted["llama"]
    codec = make_cache(f"lowrank:ratio=0.5,kinds=keys,bases={bases},compute=bfloat16", model.config).layers[0].codec
    assert codec.latent_dtype(torch.float32, "key") == torch.bfloat16
    assert codec.latent_dtype(torch.float32, "value") == torch.float32
    _, values, _ = _states(7)
    assert torch.equal(codec.decode(codec.encode(values, "value"), "value", torch.float32), values)


def test_the_ratio_is_a_share_of_the_key_dimensions():
    g = torch.Generator().manual_seed(0)
    variances = [(torch.rand(64, generator=g).sort(descending=True).values,
                  torch.rand(64, generator=g).sort(descending=True).values) for _ in range(4)]
    ranks = allocate_ranks(variances, 0.25, 8, 64, kinds=(0,))
    assert sum(key for key, _ in ranks) == 0.25 * 4 * 64
    assert all(value == 8 for _, value in ranks)  # values are not allocated (their caller keeps them whole)
    both = allocate_ranks(variances, 0.25, 8, 64)
    assert sum(k + v for k, v in both) == 0.25 * 4 * 64 * 2
    curves = [([64.0 - i for i in range(9)], [100.0 - 10 * i for i in range(9)]) for _ in range(3)]
    ranks = allocate_ranks_by_error(curves, 0.5, 8, 64, 64, kinds=(0,))
    assert sum(key for key, _ in ranks) == 0.5 * 3 * 64 and all(value == 8 for _, value in ranks)


def test_ranks_allocate_the_keys_alone(fitted):
    model, bases = fitted["llama"]
    keys_only = make_cache(f"lowrank:ratio=0.5,kinds=keys,bases={bases}", model.config).codec
    assert sum(key for key, _ in keys_only.layer_ranks) == 0.5 * 2 * 64
    assert all(value == 64 for _, value in keys_only.layer_ranks)


def test_spec_round_trips_and_bad_input_is_refused(fitted, tmp_path):
    _, codec = parse_spec("lowrank:kinds=keys,ratio=0.5+int4")
    assert codec.kinds == "keys"
    assert "kinds=keys" in codec.spec()
    assert parse_spec(codec.spec())[1] == codec
    assert parse_spec("lowrank:ratio=0.5")[1].kinds == "both"
    with pytest.raises(ValueError, match="kinds must be one of both, keys, got 'values'"):
        LowRankCodec(ratio=0.5, kinds="values")
    with pytest.raises(ValueError, match="kinds must be one of both, keys"):
        parse_spec("lowrank:kinds=all")


def test_the_study_counts_what_is_stored_and_a_saved_cache_loads(fitted, tmp_path):
    model, bases = fitted["llama"]
    spec = f"lowrank:ratio=0.5,kinds=keys,residual_length=0,bases={bases}+int4:group_size=16,residual_length=16"
    cache = filled_as_the_study_counts(model, spec)
    assert cache.layers[0].store.n_held > 0  # int4's residual holds the reduced states: keys' latents, whole values
    save_cache(cache, tmp_path / "cache")
    loaded = load_cache(tmp_path / "cache", model=model)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        for kind in ("key", "value"):
            assert torch.equal(a._full(kind), b._full(kind))
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes()


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """(model, bases dir): joint bases holding 40 of the tiny Llama's 64 components per layer (2 KV heads x 32)."""
    from hf_kvcompress.calibration import calibrate_joint, save_bases


    model = calibration_model("llama")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate_joint(model, ids, max_rank=40, text="random ids")
    return model, save_bases(tensors, metadata, tmp_path_factory.mktemp("capped")).parent


@pytest.mark.parametrize(("spec", "most"), [("lowrank:ratio=0.7", "0.625"), ("lowrank:kinds=keys,ratio=0.7", "0.625"),
                                            ("lowrank:ratio=0.625+int4:residual_length=0", "0.5"),
                                            ("lowrank:kinds=keys,ratio=0.75+int4:residual_length=0", "0.5")])
def test_a_ratio_beyond_what_the_bases_hold_is_refused(capped, spec, most):
    """40 components per layer: in steps of 8 at most 0.625 of a kind's dimensions, in int4's groups of 32 at most
    0.5; a larger ratio would keep less than it names, so it is refused, naming the most it can be."""
    model, bases = capped
    name, _, storage = spec.partition("+")
    with pytest.raises(ValueError, match=rf"ratio=0\.\d+ asks for more .* at most {most} "):
        make_cache(f"{name},bases={bases}" + (f"+{storage}" if storage else ""), model.config)


@pytest.mark.parametrize(("spec", "ranks"), [("lowrank:ratio=0.625", (40, 40)),
                                             ("lowrank:kinds=keys,ratio=0.625", (40, 64)),
                                             ("lowrank:kinds=keys,ratio=0.5+int4:residual_length=0", (32, 64))])
def test_the_most_the_bases_hold_is_accepted(capped, spec, ranks):
    model, bases = capped
    name, _, storage = spec.partition("+")
    cache = make_cache(f"{name},bases={bases}" + (f"+{storage}" if storage else ""), model.config)
    assert all(layer.codec.layer_ranks[i] == ranks for i, layer in enumerate(cache.layers))
