"""lowrank: exact on states inside the basis, bytes at the rank's rate, calibration files tied to their model."""

import pytest
import torch

from hf_kvcompress import CompressedCache, make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.calibration import calibrate, load_bases, save_bases
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.registry import parse_spec

from ..caches.tiny_models import left_padded_prompts, tiny_model


@pytest.fixture(scope="module")
def tiny():
    model = use_kvcompress_attention(tiny_model("llama"))  # 2 layers, 2 KV heads, head_dim 32
    model.config._name_or_path = "tiny-llama"
    return model


@pytest.fixture(scope="module")
def bases_dir(tiny, tmp_path_factory):
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    tensors, metadata, report = calibrate(tiny, ids, max_rank=16, text="random ids")
    assert len(report) == 2 and 0 < report[0]["key"][8] <= 1
    return save_bases(tensors, metadata, tmp_path_factory.mktemp("bases")).parent


def _nbytes(encoded):
    return sum(t.numel() * t.element_size() for t in encoded.values())


def test_states_inside_the_basis_round_trip(tiny, bases_dir):
    codec = make_cache(f"lowrank:rank=8,bases={bases_dir}", tiny.config).layers[1].codec
    basis, mean = codec._layer.key_basis, codec._layer.key_mean  # [H, D, 8], [H, D]
    coords = torch.randn(1, 2, 5, 8)
    x = torch.einsum("bhtr,hdr->bhtd", coords, basis) + mean[None, :, None]
    out = codec.decode(codec.encode(x, "key"), "key", torch.float32)
    assert torch.allclose(out, x, atol=3e-3)  # the bases are stored in fp16
    assert codec.encode(x, "key")["states"].shape == (1, 2, 5, 8)


def test_error_falls_with_rank(tiny, bases_dir):
    x = torch.randn(1, 2, 20, 32)
    errors = []
    for rank in (4, 8, 16):
        codec = make_cache(f"lowrank:rank={rank},bases={bases_dir}", tiny.config).layers[0].codec
        errors.append((codec.decode(codec.encode(x, "value"), "value", torch.float32) - x).norm())
    assert errors[0] > errors[1] > errors[2]


@pytest.mark.parametrize("spec", ["lowrank:rank=8", "lowrank:rank=16+int4:group_size=16,residual_length=2",
                                  "h2o:budget=8,recent=2+lowrank:rank=8",
                                  "sink_window:sink_tokens=2,window=6+lowrank:residual_length=0"])
def test_caches_hold_what_they_promise_and_padded_rows_match(tiny, bases_dir, spec):
    spec = spec.replace("lowrank", f"lowrank:bases={bases_dir}").replace(f"{bases_dir}:", f"{bases_dir},")
    rows, ids, mask = left_padded_prompts(seed=1, lengths=(5, 13))
    cache = make_cache(spec, tiny.config)
    batched = generate(tiny, ids, mask, cache, max_new_tokens=6).new_tokens
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    encoded = cache.layers[0].encoded_keys
    per_token = cache.layers[0].codec.bytes_per_token(32, "key", torch.float32)
    assert _nbytes(encoded) == 2 * 2 * cache.layers[0].n_encoded * per_token
    for i, row in enumerate(rows):
        alone = generate(tiny, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, tiny.config),
                         max_new_tokens=6).new_tokens
        assert torch.equal(batched[i], alone[0])


def test_bases_are_refused_for_another_model(bases_dir):
    other = tiny_model("qwen2").config
    other._name_or_path = "tiny-qwen2"
    with pytest.raises(ValueError, match="model='tiny-llama'"):
        load_bases(bases_dir, other)
    _, meta = load_bases(bases_dir / "lowrank_bases.safetensors", tiny_model("llama").config.__class__(
        **{**tiny_model("llama").config.to_dict(), "_name_or_path": "tiny-llama"}))
    assert meta["head_dim"] == "32" and meta["max_rank"] == "16" and meta["keys"] == "post_rope"


def test_bad_input_names_the_parameter(tiny, bases_dir):
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="rank"):
            LowRankCodec(rank=bad)
    with pytest.raises(ValueError, match="rank must be at most 16"):
        make_cache(f"lowrank:rank=17,bases={bases_dir}", tiny.config)
    with pytest.raises(ValueError, match="config"):
        CompressedCache(codec=LowRankCodec(rank=8, bases=str(bases_dir)))
    with pytest.raises(FileNotFoundError, match="bases="):
        make_cache(f"lowrank:bases={bases_dir}/missing", tiny.config)
    with pytest.raises(ValueError, match="no packaged"):
        make_cache("lowrank", tiny.config)
    assert parse_spec("lowrank:rank=8+int4")[1].storage.bits == 4


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma-3-270m"])
def test_packaged_bases_match_the_embedded_model(alias):
    """Each embedded model's joint bases ship, are found by the same lookup (`calibration_file` through
    `load_bases`, no `bases=`) and fit its shape; Gemma-3's sliding and global layers get their own RoPE."""
    from hf_kvcompress.calibration import JOINT, rope_frequencies
    from hf_kvcompress.hf.compat import text_config
    from hf_kvcompress.models import load_config

    config = load_config(alias)
    decoder = text_config(config)
    tensors, meta = load_bases(None, config)
    heads = getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads
    head_dim = getattr(decoder, "head_dim", None) or decoder.hidden_size // decoder.num_attention_heads
    assert meta["heads"] == JOINT and meta["keys"] == "pre_rope" and int(meta["head_dim"]) == head_dim
    assert tensors["layers.0.key_basis"].shape == (heads, head_dim, int(meta["max_rank"]))
    assert len({k for k in tensors if k.endswith("_variance")}) == 2 * decoder.num_hidden_layers
    codec = make_cache("lowrank:ratio=0.5", config).layers[0].codec
    assert codec._ranks is not None and len(codec._ranks) == decoder.num_hidden_layers
    if alias == "gemma-3-270m":
        assert len(set(rope_frequencies(config))) == 2  # sliding and full-attention layers rotate differently
