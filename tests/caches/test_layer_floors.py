"""KVzip's calibrated per-layer floors on a hybrid model (plan.py `SlidingShare.floors`, floor_calibration.py)."""

import math

import pytest
import torch
import transformers

from hf_kvcompress import CompressedCache, make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.plan import layer_floors
from hf_kvcompress.calibration import FLOORS_FORMAT, load_floors, save_floors
from hf_kvcompress.floor_calibration import calibrate_floors, scored_cache
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.policies.kvzip import KVzipPolicy
from hf_kvcompress.registry import parse_spec

from .tiny_models import tiny_model

REPEAT = [5, 6, 7]
NAME = "tiny-gemma3-floors"


def hybrid_model():
    """Two sliding and two full-attention layers (1 and 3), two KV heads each, named for calibration files."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    model.config._name_or_path = NAME
    return use_kvcompress_attention(model)


def floors_file(tmp_path, config, floors, ratios=(0.25,)):
    metadata = {"format": FLOORS_FORMAT, "model": NAME, "layers": str(config.num_hidden_layers),
                "kv_heads": str(config.num_key_value_heads)}
    tensors = {"ratios": torch.tensor(ratios, dtype=torch.float64), "layers": torch.tensor([1, 3]),
               "floors": torch.tensor(floors, dtype=torch.float64)}
    return save_floors(tensors, metadata, tmp_path)


def _ids(n, seed=16, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _reference(scores, per_head, floors):
    """Plain reference of one row: each full layer's heads keep their best ceil(floor x T) pairs, then one ranking
    of every remaining pair fills `per_head x heads x layers` in all. Returns kept counts [H] per layer."""
    T = scores[0].shape[-1]
    lifted = []
    for s, f in zip(scores, floors, strict=True):
        s = s.clone()
        count = math.ceil(f * T)
        if count:
            top = s.sort(dim=-1, descending=True, stable=True).indices[:, :count]
            s.scatter_(-1, top, float("inf"))
        lifted.append(s)
    flat = torch.cat([s.flatten() for s in lifted])
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept[flat.sort(descending=True, stable=True).indices[: per_head * scores[0].shape[0] * len(scores)]] = True
    return [k.view(s.shape).sum(-1).tolist() for k, s in zip(kept.split([s.numel() for s in scores]), scores,
                                                              strict=True)]


def test_floors_keep_each_layers_share_first_and_one_ranking_shares_the_rest(tmp_path):
    model = hybrid_model()
    ids = _ids(40)
    scored = scored_cache(model, ids[0].tolist(), "kvzip:ratio=0.25,span=0,floors=none", REPEAT)
    share = scored.sliding_share
    assert share is not None and share.floors == ()
    full = [1, 3]
    scores = [scored.layers[i].accumulated[0].clone() for i in full]  # [H, 40]
    seen = torch.tensor([40])
    per_head = int(share.extra(seen, torch.tensor([10]))[0]) + 10  # the ratio's 10 and what the sliding layers freed
    without = _reference(scores, per_head, [0.0, 0.0])
    # Floor the layer the ranking gives less, so the floor changes what is kept.
    poorer = min(range(2), key=lambda i: sum(without[i]))
    floors = [0.0, 0.0]
    floors[poorer] = 0.75
    expected = _reference(scores, per_head, floors)
    assert expected != without

    def counts(spec):  # the ratio's own plan, whose floors these are (a plain ratio is a byte target by default)
        cache = CompressedCache(*parse_spec(spec), config=model.config, ratio_bytes=False)
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        return [cache.layers[i].store.encoded.lengths[0].tolist() for i in full], cache

    got, _ = counts("kvzip:ratio=0.25,span=0,floors=none")
    assert got == without
    path = floors_file(tmp_path, model.config, [floors])
    got, cache = counts(f"kvzip:ratio=0.25,span=0,floors={path}")
    assert got == expected
    assert sum(got[poorer]) > sum(without[poorer])
    assert sum(map(sum, got)) == per_head * 2 * 2  # the same pairs in all: the floor moves them, adds none


def test_a_floored_ratio_answers_a_padded_batch_as_each_row_alone(tmp_path):
    model = hybrid_model()
    path = floors_file(tmp_path, model.config, [[0.5, 0.25]])
    spec = f"kvzip:ratio=0.25,floors={path}"
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (30, 41)]
    ids = torch.zeros(2, 41, dtype=torch.long)
    mask = torch.zeros(2, 41, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 41 - len(row):] = row
        mask[i, 41 - len(row):] = 1
    batched = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=6,
                       repeat_prompt_ids=REPEAT).new_tokens
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=6, repeat_prompt_ids=REPEAT).new_tokens
        assert torch.equal(batched[i], alone[0]), i


def test_floors_leave_a_cache_that_evicts_nothing_equal_to_dynamic(tmp_path):
    model = hybrid_model()
    path = floors_file(tmp_path, model.config, [[0.5, 0.5]], ratios=(1.0,))
    ids = _ids(30)
    ours = generate(model, ids, None, make_cache(f"kvzip:ratio=1.0,floors={path}", model.config), max_new_tokens=8,
                    repeat_prompt_ids=REPEAT).new_tokens
    theirs = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[:, 30:]
    assert torch.equal(ours, theirs)


def test_floors_file_round_trips_picks_the_nearest_ratio_and_is_refused_for_another_model(tmp_path):
    model = hybrid_model()
    path = floors_file(tmp_path, model.config, [[0.0, 0.5], [0.25, 0.75]], ratios=(0.5, 0.125))
    ratios, layers, floors = load_floors(path, model.config)
    assert ratios.tolist() == [0.5, 0.125] and layers.tolist() == [1, 3]
    assert floors.tolist() == [[0.0, 0.5], [0.25, 0.75]]
    policy = KVzipPolicy(ratio=0.2, floors=str(path))
    assert layer_floors(policy, model.config, 0.2) == ((1, 0.25), (3, 0.75))  # 0.125 is nearer on a log scale
    assert layer_floors(policy, model.config, 0.45) == ((3, 0.5),)  # a zero floor is no floor
    assert layer_floors(KVzipPolicy(ratio=0.2, floors="none"), model.config, 0.2) == ()
    assert layer_floors(KVzipPolicy(ratio=0.2), model.config, 0.2) == ()  # nothing shipped for this model
    model.config._name_or_path = "another-model"
    with pytest.raises(ValueError, match="fitted for model="):
        layer_floors(policy, model.config, 0.2)


def test_bad_floors_and_calibrations_are_refused():
    with pytest.raises(ValueError, match="floors must be"):
        KVzipPolicy(ratio=0.25, floors="")
    with pytest.raises(ValueError, match="floors must be"):
        KVzipPolicy(ratio=0.25, floors=3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="floors="):
        make_cache("kvzip:ratio=0.25,floors=/nonexistent/dir", hybrid_model().config)
    with pytest.raises(ValueError, match="hybrid model"):
        calibrate_floors(tiny_model("llama"), None)
    with pytest.raises(ValueError, match="ratios must be between 0 and 1"):
        calibrate_floors(hybrid_model(), None, ratios=(0.25, 1.0))


def test_the_calibration_keeps_a_change_of_floors_only_for_a_real_gain():
    from hf_kvcompress.floor_calibration import MIN_GAIN, better

    none = (0.5, -2.0, 0.0)
    assert better((0.6, -3.0, -0.5), none)  # more answer tokens right, whatever the log-probability
    assert not better((0.4, -1.0, -0.5), none)
    assert better((0.5, -2.0 + 2 * MIN_GAIN, -0.5), none)
    assert not better((0.5, -2.0 + MIN_GAIN / 2, -0.5), none)  # noise: the floors that change nothing stay off
    assert not better((0.5, -2.0 - 2 * MIN_GAIN, 0.0), none)
    assert better((0.5, -2.0, 0.0), (0.5, -2.0, -0.5))  # the same answers with smaller floors


def test_kvzap_takes_the_floors_too(tmp_path):
    """KVzap ranks every layer's pairs once the prompt is read, as KVzip does after its pass: a floor holds a layer's
    share first there too, and the ranking of the probe's estimates shares out the same total."""
    from .test_kvzap import write_probe

    model = hybrid_model()
    probe = write_probe(model.config, tmp_path / "probe")
    ids = _ids(40)
    full = [1, 3]

    def counts(floors):
        cache = make_cache(f"kvzap:ratio=0.25,span=0,recent=0,probe={probe},floors={floors}", model.config)
        prefill(model, ids, None, cache)
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        return [cache.layers[i].store.encoded.lengths[0].tolist() for i in full]

    without = counts("none")
    poorer = min(range(2), key=lambda i: sum(without[i]))
    assert min(without[poorer]) < 16  # so a floor of 0.4 (16 of 40 tokens per head) changes what is kept
    assert sum(map(sum, without)) > 2 * 16  # and the floors alone stay within the total
    floors = [0.0, 0.0]
    floors[poorer] = 0.4
    got = counts(floors_file(tmp_path / "floors", model.config, [floors]))
    assert min(got[poorer]) >= math.ceil(0.4 * 40)
    assert sum(map(sum, got)) == sum(map(sum, without))  # the floor moves pairs, adds none
    with pytest.raises(ValueError, match="floors must be 'none' or a path"):
        make_cache(f"kvzap:ratio=0.25,probe={probe},floors=", model.config)


@pytest.mark.parametrize("name", ["kvzip", "kvzap"])
def test_a_spec_of_floors_none_ranks_without_the_shipped_floors(tmp_path, monkeypatch, name):
    # A spec reads "none" as None elsewhere; here None means the file shipped for the model, "none" no floors.
    import hf_kvcompress.calibration as calibration

    model = hybrid_model()
    written = floors_file(tmp_path / "fitted", model.config, [[0.25, 0.75]], ratios=(0.25,))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / f"{calibration.model_identity(model.config)}{calibration.FLOORS_SUFFIX}").write_bytes(
        written.read_bytes())
    monkeypatch.setattr(calibration, "PACKAGED_DIR", shipped)
    plain, _ = parse_spec(f"{name}:ratio=0.25")
    assert plain.floors is None and layer_floors(plain, model.config, 0.25) == ((1, 0.25), (3, 0.75))
    for text in ("none", "None", "null"):
        without, _ = parse_spec(f"{name}:ratio=0.25,floors={text}")
        assert without.floors == "none" and layer_floors(without, model.config, 0.25) == ()
    assert parse_spec("int4:key_scale=none")[1].key_scale == "none"  # other fields read "none" as before
