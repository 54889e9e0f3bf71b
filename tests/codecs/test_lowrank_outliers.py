"""lowrank's outliers (`outliers`): the share of each encoded block that the codec reads back worst is kept exact
beside the sinks, paid out of the ratio's dimensions; the outliers read back exactly, follow the padding, are counted
in the promised, measured and estimated bytes, and leave a padded row answering as it does alone."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, parse_spec, use_kvcompress_attention
from hf_kvcompress.caches.codec_sinks import worst_slots
from hf_kvcompress.calibration import calibrate, save_bases
from hf_kvcompress.codecs.lowrank import LowRankCodec
from hf_kvcompress.generation import generate
from hf_kvcompress.study import promised_bytes

from ..caches.test_sinks import _forward, _padded_prompts
from ..caches.tiny_models import padded_batch_against_rows_alone, tiny_model
from .lowrank_tiny import llama_with_bases, with_bases

# Everything encoded in one block of 30 slots: int(0.125 * 30) = 3 outliers per row and layer.
SPEC = "lowrank:ratio=0.25,outliers=0.125,residual_length=0"
SAME_RANKS = "lowrank:ratio=0.125,residual_length=0"  # what the projected tokens keep under SPEC


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, joint bases dir): 2 layers, 2 KV heads, head_dim 32."""
    return llama_with_bases(tmp_path_factory)


_spec = with_bases


def test_outliers_refuse_bad_values_and_name_a_change():
    assert LowRankCodec().exact_outliers == 0.0 and parse_spec("int4")[1].exact_outliers == 0.0
    assert parse_spec("lowrank:outliers=0.02+int4")[1].exact_outliers == 0.02
    assert parse_spec("lowrank:outliers=0.02")[1].spec() == "lowrank:outliers=0.02"
    for bad in (-0.1, 1, 1.5, True, "some"):
        with pytest.raises(ValueError, match="outliers must be a number in"):
            LowRankCodec(outliers=bad)
    with pytest.raises(ValueError, match="outliers must be below ratio"):
        LowRankCodec(ratio=0.25, outliers=0.25)
    with pytest.raises(ValueError, match="outliers must be below ratio"):
        LowRankCodec(outliers=0.3)  # the default ratio, a quarter


def test_outliers_are_paid_out_of_the_ratio(llama):
    model, bases = llama
    paid = make_cache(_spec(bases, SPEC), model.config).codec
    assert paid._ranks == make_cache(_spec(bases, SAME_RANKS), model.config).codec._ranks
    assert paid._ranks != make_cache(_spec(bases, "lowrank:ratio=0.25,residual_length=0"), model.config).codec._ranks


def test_outliers_are_the_worst_read_tokens_and_read_back_exactly(llama):
    model, bases = llama
    ids, mask = _padded_prompts()  # row 0: five padding slots first
    reference = DynamicCache(config=model.config)
    cache = make_cache(_spec(bases, SPEC), model.config)
    _forward(model, ids, mask, reference)
    _forward(model, ids, mask, cache)
    for layer, exact in zip(cache.layers, reference.layers, strict=True):
        assert layer.n_encoded == 30 and layer.sink_slots.shape == (2, layer.kv_heads, 4 + 3)
        outliers = layer.sink_slots[:, 0, 4:]  # after the four sinks, in slot order
        assert layer.sink_slots[:, 0, :4].tolist() == [[5, 6, 7, 8], [0, 1, 2, 3]]
        # The codec's own errors of the exact states, padding and sinks left out, pick the same slots.
        errors = layer.codec.token_errors(exact.keys, exact.values, layer.positions)
        for row, first in ((0, 5), (1, 0)):
            ranked = [s for s in errors[row].argsort(descending=True).tolist() if s >= first + 4][:3]
            assert outliers[row].tolist() == sorted(ranked)
        for kind, states in (("key", exact.keys), ("value", exact.values)):
            full = layer._full(kind)
            slots = layer.sink_slots[..., None].expand(-1, -1, -1, states.shape[-1])
            assert torch.equal(full.gather(2, slots), states.gather(2, slots))  # sinks and outliers exact
            others = [s for s in range(9, 30) if s not in outliers[0].tolist()]
            assert not torch.equal(full[0, :, others], states[0, :, others])  # the rest projected


def test_without_outliers_the_worst_tokens_are_projected(llama):
    """What the outliers change: the same tokens under the same ranks read back with an error."""
    model, bases = llama
    ids, mask = _padded_prompts()
    reference = DynamicCache(config=model.config)
    with_, without = make_cache(_spec(bases, SPEC), model.config), make_cache(_spec(bases, SAME_RANKS), model.config)
    for cache in (reference, with_, without):
        _forward(model, ids, mask, cache)
    slots = with_.layers[1].sink_slots[1, 0, 4:]
    assert without.layers[1].sink_slots.shape[-1] == 4
    error = (without.layers[1]._full("key")[1, :, slots] - reference.layers[1].keys[1, :, slots]).abs().max()
    assert error > 1e-3
    assert torch.equal(with_.layers[1]._full("key")[1, :, slots], reference.layers[1].keys[1, :, slots])


def test_token_errors_are_the_round_trip_error_of_each_kind(llama):
    model, bases = llama
    codec = make_cache(_spec(bases, "lowrank:ratio=0.25"), model.config).layers[0].codec
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 2, 9, 32, generator=g), torch.randn(1, 2, 9, 32, generator=g)
    positions = torch.arange(9)[None, None].expand(1, 2, 9)
    parts = []
    for kind, states in (("key", keys), ("value", values)):
        at = {"positions": positions} if kind == "key" else {}
        error = (codec.decode(codec.encode(states, kind, **at), kind, torch.float32, **at) - states).square()
        parts.append(error.sum(dim=(1, 3)) / error.sum(dim=(1, 3)).mean())
    assert torch.allclose(codec.token_errors(keys, values, positions), parts[0] + parts[1])
    worst = keys.clone()
    worst[:, :, 4] *= 50  # far outside the basis' span
    assert int(codec.token_errors(worst, values, positions).argmax()) == 4


def test_worst_slots_skip_padding_and_sinks():
    errors = torch.tensor([[9.0, 8.0, 1.0, 7.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    sinks = torch.tensor([[[13]], [[-1]]])  # row 0's slot 13 is a sink; row 1 none
    picked = worst_slots(errors, 2, start=10, pads=torch.tensor([12, 14]), sinks=sinks, heads=3)
    assert picked.shape == (2, 3, 2)
    # Row 0: slots 10, 11 are padding, 13 a sink: 14 then 12. Row 1: only slot 14 is real, so one.
    assert picked[:, 0].tolist() == [[2, 4], [4, -1]]


@pytest.mark.parametrize("storage", ["", "+int4:residual_length=0,group_size=8,key_axis=token"])
def test_outlier_bytes_are_exact(llama, storage):
    """Each outlier holds every KV head's full key and value and an int64 slot; the cache promises them, the tensors
    measure them, and the study's estimate counts them."""
    model, bases = llama
    spec, without = _spec(bases, SPEC + storage), _spec(bases, SAME_RANKS + storage)
    ids, mask = _padded_prompts()
    caches = make_cache(spec, model.config), make_cache(without, model.config)
    for cache in caches:
        generate(model, ids, mask, cache, max_new_tokens=5)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    layer = caches[0].layers[0]
    assert layer.sink_slots.shape[-1] == 4 + 3  # the decode steps' one-token blocks add none
    extra = layer.batch_size * layer.kv_heads * 3 * ((layer.head_dim + layer.value_dim) * 4 + 8)
    assert measured_kv_bytes(caches[0]) - measured_kv_bytes(caches[1]) == extra * len(caches[0].layers)
    single = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=ids[1:], cache=single)
    bookkeeping = model.config.num_hidden_layers * 2 * 8  # each layer's pads and real_seen
    assert promised_bytes(spec, model.config, 30, 4) == pytest.approx(single.promised_kv_bytes() - bookkeeping)


@pytest.mark.parametrize("spec", ["lowrank:ratio=0.5,outliers=0.2,residual_length=2",
                                  "h2o:budget=10,recent=2+lowrank:ratio=0.5,outliers=0.2,residual_length=0"])
def test_padded_rows_with_outliers_match_rows_alone(llama, spec):
    model, bases = llama
    cache = padded_batch_against_rows_alone(model, _spec(bases, spec))
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert all(layer.sink_slots.shape[-1] > 4 for layer in cache.layers)


def test_head_budgets_refuse_outliers(tmp_path):
    model = use_kvcompress_attention(tiny_model("llama"))
    model.config._name_or_path = "tiny-llama"
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate(model, ids, max_rank=16, text="random ids")  # per-head bases
    bases = save_bases(tensors, metadata, tmp_path).parent
    with pytest.raises(ValueError, match="outliers"):
        make_cache(f"kvzip:ratio=0.5,budgets=head+lowrank:rank=8,outliers=0.1,bases={bases}", model.config)


def test_outliers_of_each_chunk_survive_a_save_and_load(llama, tmp_path):
    """A prompt in chunks: each chunk's encoded block keeps its own outliers; the saved cache holds them all."""
    from hf_kvcompress import load_cache, save_cache
    from hf_kvcompress.generation import prefill

    model, bases = llama
    ids, mask = _padded_prompts()
    cache = make_cache(_spec(bases, "lowrank:ratio=0.25,outliers=0.2,residual_length=0"), model.config)
    prefill(model, ids, mask, cache, chunk_size=10)  # three blocks of 10 slots: 2 outliers each
    layer = cache.layers[0]
    assert layer.sink_slots.shape[-1] == 4 + 3 * 2
    outliers = layer.sink_slots[1, 0, 4:].tolist()
    assert all(block * 10 <= s < block * 10 + 10 for block, pair in enumerate(zip(outliers[::2], outliers[1::2],
                                                                                   strict=True)) for s in pair)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors")
    assert torch.equal(loaded.layers[0].sink_slots, layer.sink_slots)
    assert measured_kv_bytes(loaded) == measured_kv_bytes(cache) == loaded.promised_kv_bytes()
    question = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(5))
    full, full_mask = torch.cat([ids, question], 1), torch.cat([mask, torch.ones_like(question)], 1)
    a = generate(model, full, full_mask, cache, max_new_tokens=4).new_tokens
    b = generate(model, full, full_mask, loaded, max_new_tokens=4).new_tokens
    assert torch.equal(a, b)
