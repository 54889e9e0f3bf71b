"""A plain KVzip ratio below a half is planned as its byte target (caches/plan.py `ratio_as_bytes`).

`kvzip:ratio=R` (R < 0.5, no codec), on a model with sliding-window layers and on one without (SmolLM2's layout),
builds the very cache `kvzip:bytes=R` builds (same layers, codecs, kept pairs and bytes: every layer in the byte
plan's int4, `int4:residual_length=8` with sliding layers and 32 without); `kvzip:ratio=R+int4` without sliding
layers builds the cache of `kvzip:bytes=R x 5/16` (the bytes R of the pairs take in int4) in that same plan; a half
and up, another codec (int8, int3, int2, an int4 with options of its own), int4 on a model with sliding layers, and a
ratio with a knob of its own plan (`sliding=`, `budgets=`) keep the ratio's plan.
"""

import copy

import pytest
import torch
import transformers

from hf_kvcompress import (
    CompressedCache,
    load_cache,
    make_cache,
    measured_kv_bytes,
    prefill,
    save_cache,
    study,
    use_kvcompress_attention,
)
from hf_kvcompress.caches import plan
from hf_kvcompress.caches.plan import plan_layers
from hf_kvcompress.generation import generate
from hf_kvcompress.measure import served_kv_bytes
from hf_kvcompress.registry import parse_spec

from .tiny_models import assert_same_state, greedy_logits_after_prefill, tiny_hybrid_gemma, tiny_model

REPEAT = [5, 6, 7]


def _prefilled(model, spec, ids):
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    return cache


def _model(layout):
    """The tiny model of a layout: Gemma-3's hybrid one (64-token windows), or a Llama (SmolLM2's family, full
    attention only) on the package's attention (KVzip's pass needs it)."""
    return tiny_hybrid_gemma() if layout == "hybrid" else use_kvcompress_attention(tiny_model("llama"))


@pytest.mark.parametrize("layout", ["hybrid", "full"])
@pytest.mark.parametrize("ratio_spec,bytes_spec", [
    ("kvzip:ratio=0.4", "kvzip:bytes=0.4"),
    ("kvzip:ratio=0.25", "kvzip:bytes=0.25"),
    ("kvzip:ratio=0.125", "kvzip:bytes=0.125"),
    ("kvzip:ratio=0.25,recent=8,decoding=evict", "kvzip:bytes=0.25,recent=8,decoding=evict"),
])
def test_a_plain_ratio_is_its_byte_target(layout, ratio_spec, bytes_spec):
    """Same plan, same kept pairs and codes, same bytes: measured = promised = the study's estimate."""
    model = _model(layout)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    by_ratio, by_bytes = _prefilled(model, ratio_spec, ids), _prefilled(model, bytes_spec, ids)
    assert by_ratio.spec == by_bytes.spec and "bytes=" in by_ratio.spec and "ratio=" not in by_ratio.spec
    assert by_ratio.byte_target == by_bytes.byte_target is not None and by_ratio.sliding_share is None
    assert by_ratio.planned_sliding == by_bytes.planned_sliding  # None at 0.4 (the whole window), and without windows
    held = _same_cache(model, ratio_spec, bytes_spec, by_ratio, by_bytes)
    # R of the uncompressed bf16 bytes, never above.
    share = float(bytes_spec.split("=")[1].split(",")[0].partition("+")[0])
    uncompressed = served_kv_bytes(_prefilled(model, "dynamic", ids), torch.bfloat16)
    assert 0.9 * share <= held / uncompressed <= share, held / uncompressed
    plans = plan_layers(*parse_spec(ratio_spec), model.config)
    assert [p.codec.spec() for p in plans] == [p.codec.spec() for p in plan_layers(*parse_spec(bytes_spec),
                                                                                    model.config)]


@pytest.mark.parametrize("layout,span,residual", [("hybrid", 4, 8), ("full", 0, 32)])
def test_a_plain_ratio_stores_every_layer_in_the_byte_plans_int4(layout, span, residual):
    """The byte plan's int4 by layout (plan.py `byte_plan_codec`): 8 exact newest tokens with sliding layers, 32
    without (what each kept more development answers with)."""
    config = _model(layout).config
    cache = make_cache("kvzip:ratio=0.25", config)
    assert cache.spec == f"kvzip:bytes=0.25,span={span}+int4:residual_length={residual}"
    assert {layer.codec.spec() for layer in cache.layers} == {f"int4:residual_length={residual}"}


def test_a_plain_ratio_keeps_more_pairs_than_its_exact_share_in_the_same_bytes():
    """Without sliding layers the byte target buys int4 pairs: about three times the ratio's share of the document
    (less the residual's and the scales' bytes), where exact pairs would hold the share itself."""
    model = _model("full")
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    cache = _prefilled(model, "kvzip:ratio=0.25", ids)
    kept = sum(int(layer.store.held_pairs().sum()) for layer in cache.layers)
    share = 0.25 * 400 * 2 * 2  # a quarter of 400 tokens, 2 layers x 2 KV heads
    assert 2 * share < kept < 4 * share, kept / share


@pytest.mark.parametrize("spec,planned", [
    ("kvzip:ratio=0.25,sliding=20", "kvzip:ratio=0.25,span=4,sliding=20"),
    ("kvzip:ratio=0.25,budgets=token", "kvzip:ratio=0.25,budgets=token,span=4"),
    ("kvzip:ratio=0.25,budgets=layer+int8", "kvzip:ratio=0.25,budgets=layer,span=4+int8"),
    ("kvzip:ratio=0.5", "kvzip:ratio=0.5,span=4"),  # a half and up: the ratio's own plan (plan.py RATIO_BYTES_BELOW)
    ("kvzip:ratio=0.75+int4", "kvzip:ratio=0.75,span=4+int4"),
    # a codec (the plain int4 too, with sliding layers): the ratio's plan (plan.py `ratio_as_bytes`,
    # plan.PLAIN_INT4)
    ("kvzip:ratio=0.25+int4", "kvzip:ratio=0.25,span=4+int4"),
    ("kvzip:ratio=0.125+int8", "kvzip:ratio=0.125,span=4+int8"),
    ("kvzip:ratio=0.25+int3", "kvzip:ratio=0.25,span=4+int3"),
    ("kvzip:ratio=0.25+int2", "kvzip:ratio=0.25,span=4+int2"),
    ("kvzip:ratio=0.25+int4:residual_length=32", "kvzip:ratio=0.25,span=4+int4:residual_length=32"),
    ("kvzip:ratio=0.25,sliding=20+int4", "kvzip:ratio=0.25,span=4,sliding=20+int4"),
    ("kvzip:ratio=0.25,budgets=token+int4", "kvzip:ratio=0.25,budgets=token,span=4+int4"),
    ("kvzip:ratio=1", "kvzip:ratio=1,span=4"),
    ("kvzip:budget=32", "kvzip:budget=32,span=4"),
    ("snapkv:ratio=0.25", None),  # no byte target: the ratio in every layer
])
def test_a_half_a_codec_or_a_knob_of_its_own_plan_keeps_the_ratios_plan(spec, planned):
    cache = make_cache(spec, tiny_hybrid_gemma().config)
    assert cache.byte_target is None
    if planned is not None:
        assert cache.spec == planned
    # the ratio's own share (`SlidingShare`): every KVzip ratio here below 1 without sliding=
    planned = spec.startswith("kvzip:ratio") and "sliding=" not in spec and "ratio=1" not in spec
    assert (cache.sliding_share is not None) == planned


@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5", "kvzip:ratio=0.25+int8", "kvzip:ratio=0.25,budgets=layer",
                                  "kvzip:ratio=0.5+int4", "kvzip:ratio=0.25+int4:residual_length=32",
                                  "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=1"])
def test_a_model_without_sliding_layers_keeps_the_ratio_from_a_half_with_a_codec_or_a_knob(spec):
    """SmolLM2's layout (full attention only): the ratio of the tokens in every layer."""
    config = tiny_model("llama").config
    cache = make_cache(spec, config)
    head, _, codec = spec.partition("+")
    assert cache.spec == f"{head},span=0" + (f"+{codec}" if codec else "")
    assert cache.byte_target is None and cache.sliding_share is None
    policy, requested = parse_spec(spec)
    assert all(plan.policy.ratio == policy.ratio for plan in plan_layers(policy, requested, config))


def test_a_ratio_of_1_on_a_hybrid_model_answers_as_dynamic_cache():
    """Nothing is evicted nor encoded: the same greedy logits as transformers' own cache."""
    model = tiny_hybrid_gemma()
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(4))
    logits = [greedy_logits_after_prefill(model, cache, ids) for cache in (
        transformers.DynamicCache(config=model.config), make_cache("kvzip:ratio=1", model.config))]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_saved_ratio_cache_loads_as_it_was_built(tmp_path):
    """A plain ratio's cache saves its byte target's spec and loads as built; a file whose spec holds a plain ratio
    was planned by the ratio's own rule (saved before) and loads so (`SlidingShare`), with the same logits."""
    model = use_kvcompress_attention(tiny_model("gemma3"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    step, where = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(9)), torch.arange(30, 33)[None]
    policy, codec = parse_spec("kvzip:ratio=0.4")  # a byte target whose sliding layers keep their whole window
    for ratio_bytes in (True, False):
        cache = CompressedCache(policy, codec, config=model.config, ratio_bytes=ratio_bytes)
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
        path = tmp_path / f"ratio-{ratio_bytes}.safetensors"
        save_cache(cache, path)
        loaded = load_cache(path)
        assert loaded.spec == cache.spec and ("bytes=" in cache.spec) == ratio_bytes
        assert (loaded.sliding_share is not None) == (not ratio_bytes) and loaded.sliding_share == cache.sliding_share
        assert [layer.policy for layer in loaded.layers] == [layer.policy for layer in cache.layers]
        assert [layer.codec for layer in loaded.layers] == [layer.codec for layer in cache.layers]
        with torch.inference_mode():
            ref = model(input_ids=step, cache=copy.deepcopy(cache), position_ids=where).logits
            out = model(input_ids=step, cache=loaded, position_ids=where).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        full = torch.cat([ids, step], 1)
        assert torch.equal(generate(model, full, torch.ones_like(full), load_cache(path), max_new_tokens=4).new_tokens,
                           generate(model, full, torch.ones_like(full), copy.deepcopy(cache),
                                    max_new_tokens=4).new_tokens)


@pytest.mark.parametrize("spec,match", [
    ("kvzip:ratio=0", "ratio must be a number in \\(0, 1\\]"),
    ("kvzip:ratio=1.5", "ratio must be a number in \\(0, 1\\]"),
    ("kvzip:ratio=0.25,bytes=0.25", "one of budget .* ratio .* or bytes"),
    ("kvzip:ratio=0.25,budgets=rows", "budgets must be one of uniform, layer, head, token"),
])
def test_bad_ratios_on_a_hybrid_model_are_refused_naming_the_parameter(spec, match):
    with pytest.raises(ValueError, match=match):
        make_cache(spec, tiny_hybrid_gemma().config)


def test_a_saved_ratio_cache_without_sliding_layers_loads_as_it_was_built(tmp_path):
    """On SmolLM2's layout a plain ratio's cache saves its byte target's spec (int4 named) and loads as built; a
    plain `bytes=` file saved when such a model kept exact pairs (its spec names no codec) loads with exact pairs,
    with the same logits."""
    model = _model("full")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    step, where = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(9)), torch.arange(30, 33)[None]
    exact = CompressedCache(*parse_spec("kvzip:bytes=0.3"), config=model.config, byte_plan=False)  # the plan before
    assert {layer.codec.spec() for layer in exact.layers} == {"identity"} and exact.spec == "kvzip:bytes=0.3,span=0"
    for cache in (make_cache("kvzip:ratio=0.3", model.config), exact):
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
        path = tmp_path / "cache.safetensors"
        save_cache(cache, path)
        loaded = load_cache(path)
        assert loaded.spec == cache.spec and loaded.byte_target == cache.byte_target
        assert [layer.codec for layer in loaded.layers] == [layer.codec for layer in cache.layers]
        assert measured_kv_bytes(loaded) == measured_kv_bytes(cache)
        with torch.inference_mode():
            ref = model(input_ids=step, cache=copy.deepcopy(cache), position_ids=where).logits
            out = model(input_ids=step, cache=loaded, position_ids=where).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [0.25, 0.125, 0.4])
def test_a_plain_ratio_in_int4_is_the_byte_target_of_its_int4_pairs(ratio):
    """`kvzip:ratio=R+int4` below a half without sliding layers (SmolLM2's layout): the cache of the plain
    `kvzip:bytes=R x 5/16` (R of the pairs at int4's 0.625 bytes a value against bf16's 2), every layer in the byte
    plan's int4 (its 32 exact newest tokens, not int4's 128), the same kept pairs, codes and bytes; measured =
    promised = the study's estimate, and at most that share of the uncompressed bytes."""
    layout = "full"
    model = _model(layout)
    assert make_cache(f"kvzip:ratio={ratio}+int4", tiny_hybrid_gemma().config).byte_target is None  # ratio's plan
    share = ratio * 5 / 16
    assert plan.ratio_codec_share(ratio, parse_spec("int4")[1], model.config) == share
    ratio_spec, bytes_spec = f"kvzip:ratio={ratio}+int4", f"kvzip:bytes={share}"
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    by_ratio, by_bytes = _prefilled(model, ratio_spec, ids), _prefilled(model, bytes_spec, ids)
    residual = 8 if layout == "hybrid" else 32
    assert by_ratio.spec == by_bytes.spec == f"kvzip:bytes={share},span={4 if layout == 'hybrid' else 0}" \
        f"+int4:residual_length={residual}"
    assert by_ratio.byte_target == by_bytes.byte_target is not None and by_ratio.sliding_share is None
    assert by_ratio.planned_sliding == by_bytes.planned_sliding
    assert by_ratio.byte_codec == by_bytes.byte_codec == plan.byte_plan_codec(plan.config_layer_types(model.config))
    assert {layer.codec.spec() for layer in by_ratio.layers} == {f"int4:residual_length={residual}"}
    held = _same_cache(model, ratio_spec, bytes_spec, by_ratio, by_bytes)
    uncompressed = served_kv_bytes(_prefilled(model, "dynamic", ids), torch.bfloat16)
    assert held <= share * uncompressed, held / uncompressed


def test_a_plain_ratio_in_int4_holds_fewer_bytes_than_the_ratios_plan():
    """Without sliding layers the ratio's own plan (`ratio_bytes=False`) keeps R of the pairs in `int4`, its newest
    128 exact; the byte plan holds R x 5/16 of the uncompressed bytes, what those pairs take in int4 without the
    exact residual's excess, so fewer bytes than the ratio's plan (which holds more than R x 5/16 on any document:
    at 2,000 tokens 0.100 of the bf16 bytes on SmolLM2, docs/results.md)."""
    model = _model("full")
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    planned = _prefilled(model, "kvzip:ratio=0.25+int4", ids)
    policy, codec = parse_spec("kvzip:ratio=0.25+int4")
    own = CompressedCache(policy, codec, config=model.config, ratio_bytes=False)
    with torch.no_grad():
        prefill(model, ids, None, own, repeat_prompt_ids=REPEAT)
    assert own.spec == "kvzip:ratio=0.25,span=0+int4" and {layer.codec.spec() for layer in own.layers} == {"int4"}
    assert own.byte_target is None
    uncompressed = served_kv_bytes(_prefilled(model, "dynamic", ids), torch.bfloat16)
    held = [served_kv_bytes(c, torch.bfloat16) for c in (planned, own)]
    assert held[0] <= 0.25 * 5 / 16 * uncompressed < held[1], [h / uncompressed for h in held]


@pytest.mark.parametrize("layout", ["hybrid", "full"])
def test_a_saved_ratio_cache_in_int4_loads_as_it_was_built(layout, tmp_path):
    """`kvzip:ratio=0.25+int4` without sliding layers saves its byte target's spec and loads as built; a file of the
    same spec built by the ratio's own plan (saved before, its spec holds the ratio; on a hybrid model that plan is
    still the default) loads by that plan, with 128 exact newest tokens and the ratio's share; each with the same
    logits and tokens as the cache saved."""
    model = tiny_hybrid_gemma() if layout == "hybrid" else _model("full")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(8))
    step, where = (torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(9)),
                   torch.arange(200, 203)[None])
    policy, codec = parse_spec("kvzip:ratio=0.25+int4")
    for planned in (True, False):
        cache = CompressedCache(policy, codec, config=model.config, ratio_bytes=planned)
        ratio_bytes = planned and layout == "full"  # a hybrid model keeps the ratio's plan (plan.PLAIN_INT4)
        with torch.no_grad():
            prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
        assert ("bytes=0.078125" in cache.spec) == ratio_bytes and ("ratio=0.25" in cache.spec) != ratio_bytes
        path = tmp_path / f"ratio-{planned}.safetensors"
        save_cache(cache, path)
        loaded = load_cache(path)
        assert loaded.spec == cache.spec and loaded.byte_target == cache.byte_target
        assert loaded.sliding_share == cache.sliding_share
        # no byte plan to record on either layout: without sliding layers the spec names the codec every layer ran
        assert loaded.byte_codec is None
        assert [layer.policy for layer in loaded.layers] == [layer.policy for layer in cache.layers]
        assert [layer.codec for layer in loaded.layers] == [layer.codec for layer in cache.layers]
        assert ({layer.codec.residual_length for layer in loaded.layers} == {128}) != ratio_bytes
        assert measured_kv_bytes(loaded) == measured_kv_bytes(cache)
        with torch.inference_mode():
            ref = model(input_ids=step, cache=copy.deepcopy(cache), position_ids=where).logits
            out = model(input_ids=step, cache=loaded, position_ids=where).logits
        # within float32 rounding: a loaded int4 store holds its tokens without the built one's spare slots
        # (docs/results.md, "The byte plan's exact residual of 8 tokens")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        full = torch.cat([ids, step], 1)
        assert torch.equal(generate(model, full, torch.ones_like(full), load_cache(path), max_new_tokens=4).new_tokens,
                           generate(model, full, torch.ones_like(full), copy.deepcopy(cache),
                                    max_new_tokens=4).new_tokens)


def _same_cache(model, ratio_spec, bytes_spec, by_ratio, by_bytes) -> int:
    """The bf16 bytes two caches built from a ratio and the byte target it is planned as hold, after checking they
    hold the same state and bytes (measured, promised and the study's estimate alike)."""
    assert_same_state(by_ratio, by_bytes)
    held = served_kv_bytes(by_ratio, torch.bfloat16)
    assert held == served_kv_bytes(by_bytes, torch.bfloat16)
    assert measured_kv_bytes(by_ratio) == by_ratio.promised_kv_bytes()
    assert study.promised_bytes(ratio_spec, model.config, 400, 2) == study.promised_bytes(bytes_spec, model.config,
                                                                                           400, 2)
    return held
