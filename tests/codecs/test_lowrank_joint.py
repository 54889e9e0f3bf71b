"""lowrank on joint bases (one per layer over its KV heads, keys before RoPE): full rank equals DynamicCache, the
reconstruction is the plain PCA projection, RoPE after the latent equals RoPE before it, ranks follow the variances,
bytes are exact, the bases are tied to their model."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, make_cache, measured_kv_bytes
from hf_kvcompress.calibration import concatenated, load_bases, save_bases
from hf_kvcompress.codecs.lowrank import LowRankCodec, allocate_ranks
from hf_kvcompress.generation import generate
from hf_kvcompress.ops.rerotate import rerotate

from ..caches.tiny_models import (
    calibration_model,
    filled_as_the_study_counts,
    fitted_joint_bases,
    left_padded_prompts,
    prompt_then_steps,
    tiny_model,
)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """{family: (model, bases dir)}: every component kept, so ratio=1.0 is full rank."""
    return fitted_joint_bases(tmp_path_factory.mktemp)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", ["", "sink_window:sink_tokens=2,window=1000+"])
def test_full_rank_equals_dynamic_cache(fitted, family, policy):
    model, bases = fitted[family]
    # Keys rebuilt in float32: this checks the algebra to float32's rounding (a bf16 product, `compute`'s default on
    # a CPU that multiplies bf16 natively, rounds keys by ~2^-9: test_lowrank_attention.py bounds what that costs).
    cache = make_cache(f"{policy}lowrank:ratio=1.0,bases={bases},compute=float32", model.config)
    delta = (prompt_then_steps(model, cache) - prompt_then_steps(model, DynamicCache())).abs().max()
    assert cache.layers[-1].n_encoded == 35  # every token was read back from its latent
    assert delta < 1e-4


def test_reconstruction_is_the_pca_projection_and_rope_commutes(fitted):
    model, bases = fitted["llama"]
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[1].codec
    tensors, _ = load_bases(bases, model.config)
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 7, 32, generator=g)  # post-RoPE, as the cache receives them
    positions = torch.randint(0, 500, (1, 2, 7), generator=g).to(torch.int32)
    inv_freq = codec._inv_freq()
    unrotated = rerotate(keys, -positions, inv_freq)
    # The reference: a plain projection of the concatenated pre-RoPE heads on the file's first r components.
    rank = codec._ranks[1][0]
    basis, _ = torch.linalg.qr(tensors["layers.1.key_basis"][..., :rank].double().reshape(64, rank))
    mean = tensors["layers.1.key_mean"].double().reshape(64)
    flat = concatenated(unrotated[0].double())[0]  # [T, H * D]
    projected = ((flat - mean) @ basis @ basis.T + mean).reshape(7, 2, 32).permute(1, 0, 2)[None]
    expected = rerotate(projected.float(), positions, inv_freq)
    decoded = codec.decode(codec.encode(keys, "key", positions=positions), "key", torch.float32, positions=positions)
    assert torch.allclose(decoded, expected, atol=1e-4)
    # Turning every key by the same extra positions before encoding turns the decoded keys by as much.
    shifted = codec.decode(codec.encode(rerotate(keys, positions * 0 + 9, inv_freq), "key", positions=positions + 9),
                           "key", torch.float32, positions=positions + 9)
    assert torch.allclose(shifted, rerotate(decoded, positions * 0 + 9, inv_freq), atol=1e-4)
    assert codec.encode(keys, "key", positions=positions)["states"].shape == (1, 1, 7, rank)  # one latent per token


def test_ranks_follow_the_variances_and_keep_the_ratio():
    flat, steep = torch.ones(64), torch.tensor([2.0 ** -i for i in range(64)])
    ranks = allocate_ranks([(steep, flat), (steep, steep)], ratio=0.5, step=8, max_rank=64)
    assert sum(sum(r) for r in ranks) == 0.5 * 4 * 64
    assert ranks[0][1] > ranks[0][0] and ranks[0][1] > ranks[1][1]  # the flat spectrum needs the most dimensions
    assert all(8 <= r <= 64 and r % 8 == 0 for pair in ranks for r in pair)
    assert allocate_ranks([(steep, flat)], ratio=1.0, step=8, max_rank=32) == [(32, 32)]


def test_a_floored_layer_keeps_the_ratio_and_the_others_pay_for_it():
    flat, steep = torch.ones(64), torch.tensor([2.0 ** -i for i in range(64)])
    variances = [(steep, flat), (steep, flat), (steep, steep)]
    plain = allocate_ranks(variances, ratio=0.5, step=8, max_rank=64)
    floored = allocate_ranks(variances, ratio=0.5, step=8, max_rank=64, floored=(False, False, True))
    assert max(plain[2]) < 32  # a steep spectrum gets less than the ratio by variance
    assert floored[2] == (32, 32)  # at least half of each kind's 64 dimensions
    assert sum(sum(r) for r in floored) == sum(sum(r) for r in plain) == 0.5 * 6 * 64  # the ratio still holds
    assert all(f <= p for f, p in zip(floored[0] + floored[1], plain[0] + plain[1], strict=True))
    # The floor is at most what the bases hold; no layer floored is the plain allocation.
    assert allocate_ranks(variances, ratio=0.5, step=8, max_rank=16, floored=(False, False, True))[2] == (16, 16)
    assert allocate_ranks(variances, ratio=0.5, step=8, max_rank=64, floored=(False,) * 3) == plain


def test_floor_full_keeps_the_ratio_in_a_hybrid_models_full_attention_layers(fitted):
    model, bases = fitted["gemma3"]  # layers: sliding, sliding, full attention
    plain = make_cache(f"lowrank:ratio=0.25,floor=none,bases={bases}", model.config).codec
    floored = make_cache(f"lowrank:ratio=0.25,floor=full,bases={bases}", model.config).codec
    assert all(rank >= 8 for rank in floored._ranks[2])  # a quarter of 32 dimensions, in steps of 8
    assert sum(map(sum, floored._ranks)) == sum(map(sum, plain._ranks))
    # `full` is the default and is left out of the spec; `none` is written out and reads back as itself.
    assert "floor" not in floored.spec() and "floor=none" in plain.spec()
    assert make_cache(plain.spec(), model.config).codec.floor == "none"
    assert make_cache(f"lowrank:ratio=0.25,bases={bases}", model.config).codec._ranks == floored._ranks
    assert len(set(make_cache(f"lowrank:rank=2,bases={bases}", model.config).codec._ranks)) == 1  # rank=: every layer
    # Without sliding layers every layer reads the whole document: the floor changes nothing.
    llama, llama_bases = fitted["llama"]
    assert (make_cache(f"lowrank:ratio=0.25,floor=full,bases={llama_bases}", llama.config).codec._ranks
            == make_cache(f"lowrank:ratio=0.25,bases={llama_bases}", llama.config).codec._ranks)


def test_floor_refuses_bad_values():
    with pytest.raises(ValueError, match="floor must be one of none, full"):
        LowRankCodec(ratio=0.5, floor="sliding")


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5",
                                  "lowrank:ratio=0.5+int4:group_size=16,residual_length=2,key_axis=token",
                                  "h2o:budget=8,recent=2+lowrank:ratio=0.5",
                                  "tova:ratio=0.5+lowrank:ratio=0.25,residual_length=0"])
def test_bytes_are_exact_and_padded_rows_match_rows_alone(fitted, spec):
    model, bases = fitted["llama"]
    spec = spec.replace("lowrank:", f"lowrank:bases={bases},")
    rows, ids, mask = left_padded_prompts(seed=3, lengths=(5, 13))
    cache = make_cache(spec, model.config)
    batched = generate(model, ids, mask, cache, max_new_tokens=6).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for layer in cache.layers:
        encoded = sum(t.numel() * t.element_size() for t in layer.encoded_keys.values())
        assert encoded == 2 * layer.n_encoded * layer.codec.bytes_per_token(32, "key", torch.float32) * 2
        # The positions the keys decode at: one per slot for both KV heads, until an eviction keeps slots per head.
        heads = 2 if spec.startswith(("h2o", "tova")) else 1
        assert layer.positions.shape == (2, heads, layer.stored_tokens)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0])


def test_the_study_counts_the_latents_and_positions(fitted):
    model, bases = fitted["llama"]
    filled_as_the_study_counts(model, f"lowrank:ratio=0.5,bases={bases}")


def test_bases_count_once_per_model_not_per_cache(fitted):
    model, bases = fitted["llama"]
    first, second = (make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config) for _ in range(2))
    assert measured_kv_bytes(first) == measured_kv_bytes(second) == 0  # nothing held before the first token
    codec = first.codec
    # float32 means and bases of keys and values: 2 layers x 2 kinds x 64 x (32 + 1)
    assert codec.model_bytes() == 2 * 2 * 64 * (32 + 1) * 4


def test_bases_are_refused_for_another_model_and_bad_input(fitted):
    model, bases = fitted["llama"]
    other = tiny_model("qwen2").config
    other._name_or_path = "tiny-qwen2"
    with pytest.raises(ValueError, match="model='tiny-llama'"):
        make_cache(f"lowrank:ratio=0.5,bases={bases}", other)
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="ratio"):
            LowRankCodec(ratio=bad)
    with pytest.raises(ValueError, match="rank or ratio"):
        LowRankCodec(rank=8, ratio=0.5)
    with pytest.raises(ValueError, match="budgets=layer"):
        make_cache(f"kvzip:ratio=0.5,budgets=head+lowrank:ratio=0.5,bases={bases}", model.config)
    with pytest.raises(ValueError, match="config"):
        CompressedCache(codec=LowRankCodec(ratio=0.5, bases=str(bases)))
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[0].codec
    with pytest.raises(ValueError, match="positions="):
        codec.encode(torch.randn(1, 2, 3, 32), "key")
    with pytest.raises(ValueError, match=r"positions must be \[B, H_kv, T\]"):
        codec.encode(torch.randn(1, 2, 3, 32), "key", positions=torch.zeros(1, 2, 4, dtype=torch.int32))


def test_per_head_bases_refuse_a_ratio(tmp_path):
    from hf_kvcompress.calibration import calibrate

    model = calibration_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate(model, ids, max_rank=16, text="random ids")
    bases = save_bases(tensors, metadata, tmp_path).parent
    with pytest.raises(ValueError, match="ratio needs joint bases"):
        make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config)


@pytest.mark.parametrize("layer_idx", [0, 2])
def test_sliding_and_full_layers_undo_their_own_rope(fitted, layer_idx):
    """Gemma-3's sliding layers rotate keys at another base than its full-attention ones: each layer's codec
    projects the keys with its own layer type's RoPE undone (a lower rank does not commute with a rotation, so
    another layer's frequencies would reconstruct other keys)."""
    from hf_kvcompress.calibration import layer_states
    from hf_kvcompress.hf.rope import rope_inv_freq

    model, bases = fitted["gemma3"]
    layer_type = model.config.layer_types[layer_idx]
    inv_freq = rope_inv_freq(model.config, layer_type)
    other = rope_inv_freq(model.config, "full_attention" if layer_type == "sliding_attention" else "sliding_attention")
    assert not torch.allclose(inv_freq, other)  # the test can tell them apart
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[layer_idx].codec
    assert torch.equal(codec._inv_freq(), inv_freq)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    keys = layer_states(model, ids)[layer_idx][0][None]  # [1, 1, 20, 32], post-RoPE as the cache receives them
    positions = torch.arange(20, dtype=torch.int32)[None, None]
    tensors, _ = load_bases(bases, model.config)
    rank = codec._ranks[layer_idx][0]
    assert rank < 32
    basis, _ = torch.linalg.qr(tensors[f"layers.{layer_idx}.key_basis"][0, :, :rank].double())
    mean = tensors[f"layers.{layer_idx}.key_mean"].double()[0]

    def reference(freq):
        flat = rerotate(keys, -positions, freq)[0, 0].double()
        return rerotate(((flat - mean) @ basis @ basis.T + mean).float()[None, None], positions, freq)

    decoded = codec.decode(codec.encode(keys, "key", positions=positions), "key", torch.float32, positions=positions)
    assert torch.allclose(decoded, reference(inv_freq), atol=1e-4)
    assert not torch.allclose(decoded, reference(other), atol=1e-3)


def test_bases_move_to_the_states_device_once(fitted):
    """A layer's bases belong to its cache: read on another device they move there once (the meta device stands in
    for a GPU), so the decode step does not copy them from the host per layer and step."""
    model, bases = fitted["llama"]
    codec = make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).layers[1].codec
    kv_heads = model.config.num_key_value_heads
    states = torch.randn(1, kv_heads, 5, model.config.head_dim, device="meta")
    assert codec.expand(codec.reduce(states, "value"), "value", torch.float32).device.type == "meta"
    layer = codec._layer
    names = [name for name in layer.__slots__ if name != "kernel_keys"]  # the CPU kernel's copies: made on CPU only
    moved = [getattr(layer, name) for name in names]
    assert all(t.device.type == "meta" for t in moved) and not layer.kernel_keys
    codec.reduce(states, "key")
    assert all(getattr(layer, name) is t for name, t in zip(names, moved, strict=True))


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5", "lowrank:ratio=0.25,residual_length=4"])
def test_bfloat16_latents_are_stored_at_the_states_width(fitted, spec):
    # Keys are turned back in float32 before the projection; their latents were once stored in float32 in a bf16
    # run (the measured bytes 1.4x the promised ones at 4k on SmolLM2).
    model, bases = fitted["llama"]
    model = model.to(torch.bfloat16)
    try:
        cache = make_cache(spec.replace("lowrank:", f"lowrank:bases={bases},"), model.config)
        ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
    finally:
        model.to(torch.float32)
    assert all(t.dtype == torch.bfloat16 for layer in cache.layers for t in layer.encoded_keys.values())
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_layer_ranks_are_each_layers_bound_ranks(fitted):
    model, bases = fitted["gemma3"]
    codec = make_cache(f"lowrank:ratio=0.25,bases={bases}", model.config).codec
    ranks = codec.layer_ranks
    assert ranks is not None and len(ranks) == model.config.num_hidden_layers
    assert ranks == codec._ranks  # the allocation's (key, value) ranks, one pair per layer
    # every layer's bound copy reads the same table and rebuilds with its own pair's widths
    cache = make_cache(f"lowrank:ratio=0.25,bases={bases}", model.config)
    for i, layer in enumerate(cache.layers):
        assert layer.codec.layer_ranks == ranks
        assert layer.codec._layer.key_basis.shape[-1] == ranks[i][0]
        assert layer.codec._layer.value_basis.shape[-1] == ranks[i][1]
    assert LowRankCodec(ratio=0.25).layer_ranks is None  # not bound to a model
