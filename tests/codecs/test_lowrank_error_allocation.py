"""lowrank's ranks by attention-output error (`allocate=error`): the calibrated curves equal a plain reference
(attention recomputed head by head), the greedy allocation keeps the ratio and spends it where the error falls most,
the curves survive a save and load, full rank still equals DynamicCache, bytes are exact, bad input is refused."""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes
from hf_kvcompress.calibration import (
    ERROR_STEP,
    attention_captures,
    calibrate_joint,
    error_curves,
    load_bases,
    save_bases,
)
from hf_kvcompress.codecs.lowrank import LowRankCodec, allocate_ranks_by_error
from hf_kvcompress.ops.rerotate import rerotate

from .lowrank_tiny import fit_with_errors


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """{family: (model, bases dir, fit ids, held-out ids)}: bases with error curves on held-out ids."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for family in ("llama", "gemma3"):
        model, tensors, metadata, ids, held = fit_with_errors(family, g)
        out[family] = model, save_bases(tensors, metadata, tmp_path_factory.mktemp(family)).parent, ids, held
    return out


def _reference_error(model, ids, tensors, layer, key_rank, value_rank, queries, sinks=4):
    """The relative attention-output error of `layer` written out plainly: each query head against its KV head,
    keys projected with RoPE undone on the first `rank` components of the file's basis, the first `sinks` exact."""
    from hf_kvcompress.calibration import rope_frequencies

    capture = attention_captures(model, ids, queries)[layer]
    keys, values, query = capture["keys"].double(), capture["values"].double(), capture["query"].double()
    heads, length, dim = keys.shape
    inv_freq = torch.tensor(rope_frequencies(model.config)[layer])
    positions = torch.arange(length, dtype=torch.float32)[None, None].expand(1, heads, -1)

    def project(x, kind, rank):
        basis, _ = torch.linalg.qr(tensors[f"layers.{layer}.{kind}_basis"].double().reshape(heads * dim, -1))
        basis = basis * torch.sign(torch.diagonal(
            torch.linalg.qr(tensors[f"layers.{layer}.{kind}_basis"].double().reshape(heads * dim, -1))[1]))[None]
        mean = tensors[f"layers.{layer}.{kind}_mean"].double().reshape(-1)
        flat = x.transpose(0, 1).reshape(length, -1) - mean
        out = (flat @ basis[:, :rank] @ basis[:, :rank].T + mean).reshape(length, heads, dim).transpose(0, 1)
        return torch.cat([x[:, :sinks], out[:, sinks:]], 1)

    plain = rerotate(keys.float()[None], -positions, inv_freq)[0].double()
    approx_keys = rerotate(project(plain, "key", key_rank).float()[None], positions, inv_freq)[0].double()
    approx_values = project(values, "value", value_rank)
    weight = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
    groups = query.shape[0] // heads

    def output(k, v):
        rows = []
        for head in range(query.shape[0]):
            out = []
            for q_index in range(queries):
                position = length - queries + q_index
                lo = 0 if not capture["window"] else max(0, position - capture["window"] + 1)
                logits = k[head // groups, lo: position + 1] @ query[head, q_index] * capture["scaling"]
                out.append(logits.softmax(0) @ v[head // groups, lo: position + 1])
            rows.append(torch.stack(out))
        return torch.cat(rows, -1) @ weight.T  # [Q, hidden]: heads side by side, as the model's o_proj reads them

    exact = output(keys, values)
    return float((output(approx_keys, approx_values) - exact).pow(2).sum() / exact.pow(2).sum())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_error_curves_equal_a_plain_reference(fitted, family):
    model, bases, _, held = fitted[family]
    tensors, metadata = load_bases(bases, model.config)
    assert metadata["error_step"] == str(ERROR_STEP)
    curves = error_curves(model, attention_captures(model, held, 16), tensors, ERROR_STEP)
    for layer in (0, len(curves) - 1):  # gemma3's last layer reads everything, its first a sliding window
        key, value = curves[layer]
        assert key[-1] < 1e-8 and value[-1] < 1e-8  # the whole width rebuilds every state
        assert key[1] == pytest.approx(_reference_error(model, held, tensors, layer, 8, 64, 16), rel=1e-3, abs=1e-7)
        assert value[2] == pytest.approx(_reference_error(model, held, tensors, layer, 64, 16, 16), rel=1e-3, abs=1e-7)
    # The file's curves are the same measurement at the calibration's query count (on the bases before the file
    # rounded them to half precision).
    stored = error_curves(model, attention_captures(model, held, int(metadata["error_queries"])), tensors)
    assert torch.allclose(tensors["layers.1.value_error"], torch.tensor(stored[1][1]), atol=1e-3)


def test_the_allocation_keeps_the_ratio_and_spends_it_where_the_error_falls():
    width = 64
    falls_fast = [math.exp(-r / 8) for r in range(0, width + 1, 8)]
    falls_slowly = [1 - r / width for r in range(0, width + 1, 8)]
    late = [1.0] * 5 + [0.0] * 4  # flat for four steps, then all of it: only a look over a run of steps sees it
    ranks = allocate_ranks_by_error([(falls_fast, falls_slowly), (late, falls_fast)], 0.5, 8, 64, width)
    assert sum(map(sum, ranks)) == 0.5 * 4 * width
    assert ranks[0][1] > ranks[0][0]  # the slowly falling kind needs more dimensions
    assert ranks[1][0] >= 40  # the late drop is bought whole
    assert all(8 <= r <= 64 and r % 8 == 0 for pair in ranks for r in pair)
    assert allocate_ranks_by_error([(falls_fast, late)], 1.0, 8, 64, width) == [(64, 64)]
    floored = allocate_ranks_by_error([(falls_fast, falls_fast), (falls_slowly, falls_slowly)], 0.5, 8, 64, width,
                                      floored=(True, False))
    assert min(floored[0]) >= 32 and sum(map(sum, floored)) == 128
    # Steps of 32 (int4's groups) read every fourth point of the curves.
    coarse = allocate_ranks_by_error([(falls_fast, falls_slowly)], 0.5, 32, 64, width)
    assert all(r % 32 == 0 for r in coarse[0]) and sum(coarse[0]) == 64
    with pytest.raises(ValueError, match="step must be a multiple"):
        allocate_ranks_by_error([(falls_fast, falls_slowly)], 0.5, 12, 64, width)


def test_error_is_the_default_with_curves_and_full_rank_equals_dynamic_cache(fitted):
    model, bases, _, _ = fitted["llama"]
    # Below a half the curves spread the dimensions; from a half on, the variances.
    chosen = make_cache(f"lowrank:ratio=0.25,bases={bases}", model.config).codec
    assert chosen._ranks == make_cache(f"lowrank:ratio=0.25,allocate=error,bases={bases}", model.config).codec._ranks
    by_variance = make_cache(f"lowrank:ratio=0.25,allocate=variance,bases={bases}", model.config).codec
    assert sum(map(sum, chosen._ranks)) == sum(map(sum, by_variance._ranks)) == 0.25 * 2 * 2 * 64
    assert chosen._ranks != by_variance._ranks
    assert (make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).codec._ranks
            == make_cache(f"lowrank:ratio=0.5,allocate=variance,bases={bases}", model.config).codec._ranks)
    # compute=float32: full rank equals DynamicCache to float32's rounding (bf16 keys: test_lowrank_attention.py)
    cache = make_cache(f"lowrank:ratio=1.0,allocate=error,bases={bases},compute=float32", model.config)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids, cache=cache).logits
        step = model(input_ids=ids[:, -1:], cache=cache).logits
        dynamic = DynamicCache()
        theirs = model(input_ids=ids, cache=dynamic).logits
        theirs_step = model(input_ids=ids[:, -1:], cache=dynamic).logits
    assert (ours - theirs).abs().max() < 1e-4 and (step - theirs_step).abs().max() < 1e-4
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_bytes_follow_the_error_ranks(fitted):
    model, bases, _, _ = fitted["gemma3"]
    cache = make_cache(f"lowrank:ratio=0.25,residual_length=0,bases={bases}", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for layer in cache.layers:
        key_rank, value_rank = layer.codec._ranks[layer.codec._layer_idx]
        encoded = sum(t.numel() * t.element_size() for t in layer.encoded_values.values())
        width = torch.empty((), dtype=layer.codec.latent_dtype(torch.float32, "value")).element_size()
        assert encoded == layer.n_encoded * value_rank * width  # one latent of value_rank per token, as stored


def test_bad_allocate_is_refused(fitted, tmp_path):
    with pytest.raises(ValueError, match="allocate must be one of copy, error, variance"):
        LowRankCodec(ratio=0.5, allocate="attention")
    with pytest.raises(ValueError, match="allocate spreads a ratio"):
        LowRankCodec(rank=8, allocate="error")
    model, _, ids, _ = fitted["llama"]
    tensors, metadata, _ = calibrate_joint(model, ids, text="random ids")  # no curves
    bases = save_bases(tensors, metadata, tmp_path).parent
    with pytest.raises(ValueError, match="allocate=error needs bases with attention-error curves"):
        make_cache(f"lowrank:ratio=0.5,allocate=error,bases={bases}", model.config)
    assert make_cache(f"lowrank:ratio=0.5,bases={bases}", model.config).codec._ranks is not None  # variance
