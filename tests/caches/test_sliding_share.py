"""Sliding-window layers keep the policy's budget or ratio too, so a ratio sets the bytes on hybrid models.

A sliding layer that keeps fewer tokens than its window must attend over exactly what a full-attention layer with
the same policy keeps. On a tiny Gemma-3 whose sliding and full layers share one RoPE base, a prompt shorter than the
window never meets the sliding mask, so the hybrid model and the same weights with every layer full attention must
give the same logits under the same evicting cache.
"""

import math

import pytest
import torch
import transformers

from hf_kvcompress import CompressedCache, make_cache, measured_kv_bytes, prefill, use_kvcompress_attention
from hf_kvcompress.hf.compat import cache_kwargs
from hf_kvcompress.registry import parse_spec

from .tiny_models import COMMON, greedy_logits_after_prefill, left_padded_prompts

WINDOW = 16  # sliding_window: 15 tokens kept between steps
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
REPEAT = [5, 6, 7]


def _model(layer_types):
    config = transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=layer_types, rope_parameters={"sliding_attention": dict(ROPE), "full_attention": dict(ROPE)},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # kvcompress_sdpa: KVzip's reconstruction pass needs its attention statistics (sdpa alone is refused).
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return use_kvcompress_attention(model)


HYBRID = ["sliding_attention", "sliding_attention", "full_attention"]


def _logits(model, spec, prompt, steps):
    """Prefill `prompt`, then feed `steps` greedy tokens one at a time; every step's logits."""
    cache = make_cache(spec, model.config)
    out = []
    with torch.no_grad():
        logits = model(input_ids=prompt, use_cache=True, **cache_kwargs(cache)).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, use_cache=True, **cache_kwargs(cache)).logits[:, -1]
            out.append(logits)
    return torch.stack(out), cache


@pytest.mark.parametrize("spec", ["sink_window:sink_tokens=0,window=6", "sink_window:sink_tokens=0,window=3",
                                  "sink_window:sink_tokens=0,window=6+int8"])
def test_a_sliding_layer_under_a_budget_attends_as_a_full_layer_with_that_budget(spec):
    hybrid = _model(HYBRID)
    full = _model(["full_attention"] * 3)
    full.load_state_dict(hybrid.state_dict())
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    steps = 4  # 10 + 4 tokens < the window: the sliding mask hides nothing, only the budget does
    ours, cache = _logits(hybrid, spec, prompt, steps)
    reference, _ = _logits(full, spec, prompt, steps)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    budget = cache.policy.budget
    assert [layer.stored_tokens for layer in cache.layers] == [budget] * 3
    # Before sliding layers kept the budget they held 14 tokens here, and the logits differed.
    whole, _ = _logits(hybrid, "dynamic", prompt, steps)
    assert not torch.allclose(ours[1:], whole[1:], atol=1e-3)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8])
def test_a_ratio_keeps_that_share_of_the_sliding_window_and_bytes_match_the_promise(ratio):
    model = _model(HYBRID)
    spec = f"h2o:ratio={ratio},recent=2"  # a ratio no reconstruction pass plans: the same share in every layer
    cache = make_cache(spec, model.config)
    tokens = 40
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefill(model, ids, None, cache)
    sliding = [layer.stored_tokens for layer in cache.layers if layer.is_sliding]
    assert sliding == [math.ceil(ratio * (WINDOW - 1))] * 2
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert full[0].stored_tokens == math.ceil(ratio * tokens)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def _planned(ratio: float, tokens: int, window: int = WINDOW, sliding_layers: int = 2, full_layers: int = 1):
    """A plain reference of the planned share: (tokens per sliding layer, tokens per KV head per full layer)."""
    held = min(tokens, window - 1)
    window_share = math.ceil(ratio * (window - 1))
    # r x r of the window from a half up, 2 x r x r x r below, at least a 32nd of it, at most the ratio's share
    planned = 1.5 * ratio * ratio if ratio >= 0.5 else 2 * ratio ** 3  # KVzip's rule: plan.py kvzip_sliding_share
    sliding = min(window_share, max(math.ceil(planned * (window - 1)), math.ceil((window - 1) / 32)))
    share = math.ceil(ratio * tokens)
    freed = max(math.ceil(ratio * held) - min(held, sliding), 0) * sliding_layers
    return min(sliding, held), min(share + freed // full_layers, tokens)


@pytest.mark.parametrize("budgets", ["head", "layer", "uniform", "token"])
@pytest.mark.parametrize("ratio,tokens", [(0.25, 40), (0.5, 40), (0.5, 9), (0.125, 60), (0.9, 40)])
def test_a_plain_kvzip_ratio_gives_the_full_layers_what_the_sliding_layers_give_up(budgets, ratio, tokens):
    """The cache still holds the ratio of its uncompressed pairs (to rounding), more of them in the full layer. A
    plain ratio with head budgets is planned as its byte target (tests/caches/test_ratio_bytes.py); this plan is
    then the one `ratio_bytes=False` builds (research, and caches saved before)."""
    from hf_kvcompress.study import promised_bytes

    model = _model(HYBRID)
    spec = f"kvzip:ratio={ratio}" + ("" if budgets == "head" else f",budgets={budgets}")
    if budgets == "head":
        cache = CompressedCache(*parse_spec(spec), config=model.config, ratio_bytes=False)
    else:
        cache = make_cache(spec, model.config)
    assert cache.spec == spec + ",span=4"  # the spec names the span the hybrid layout chose
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    sliding, full = _planned(ratio, tokens)
    assert [layer.stored_tokens for layer in cache.layers] == [sliding, sliding, full]
    uncompressed = 2 * min(tokens, WINDOW - 1) + tokens
    assert 2 * sliding + full <= max(math.ceil(ratio * uncompressed) + 2, 2 * sliding + math.ceil(ratio * tokens))
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    if budgets != "head":  # a per-head store's estimate is bounded, not exact (tests/test_study_bytes.py)
        # the estimate leaves out each layer's bookkeeping, and the full layer's budget shift ([1] int64)
        assert promised_bytes(spec, model.config, tokens, 4) == cache.promised_kv_bytes() - 3 * 2 * 8 - 8


def test_the_planned_share_holds_while_decoding_and_an_explicit_sliding_keeps_the_plain_share():
    model = _model(HYBRID)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    planned = make_cache("kvzip:ratio=0.5,budgets=uniform", model.config)
    explicit = make_cache("kvzip:ratio=0.5,budgets=uniform,sliding=6", model.config)  # the plan's ceil(0.375 x 15)
    for cache in (planned, explicit):
        with torch.inference_mode():
            prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=REPEAT)
            model.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False)
    seen = 39 + 1 + 5  # the prompt, its last token fed by generate, five decoded tokens (the sixth is not fed)
    _, full = _planned(0.5, 39)
    extra = full - math.ceil(0.5 * 39)
    assert [layer.stored_tokens for layer in planned.layers] == [6, 6, math.ceil(0.5 * seen) + extra]
    assert [layer.stored_tokens for layer in explicit.layers] == [6, 6, math.ceil(0.5 * seen)]


@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=0,group_size=8",
                                  "sink_window:sink_tokens=4,window=20", "h2o:budget=15,recent=4"])
def test_a_budget_at_or_above_the_window_leaves_the_sliding_window_as_it_was(spec):
    model = _model(HYBRID)
    cache = make_cache(spec, model.config)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    for layer in cache.layers:
        if layer.is_sliding:
            assert WINDOW - 1 <= layer.stored_tokens <= WINDOW - 1 + 7


@pytest.mark.parametrize("spec", ["sink_window:sink_tokens=0,window=6",
                                  "kvzip:ratio=0.5+int4:residual_length=0,group_size=8",
                                  "sink_window:sink_tokens=0,window=6+int2:residual_length=0,group_size=8"])
@pytest.mark.parametrize("tokens", [5, 13, 31])
def test_study_estimate_equals_the_promise_of_a_reduced_sliding_window(spec, tokens):
    from hf_kvcompress.study import promised_bytes

    model = _model(HYBRID)
    cache = make_cache(spec, model.config)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert all(layer.codec.key_axis == "token" for layer in sliding if hasattr(layer.codec, "key_axis"))
    bookkeeping = model.config.num_hidden_layers * 2 * 8
    if spec.startswith("sink_window"):
        assert promised_bytes(spec, model.config, tokens, 4) == pytest.approx(cache.promised_kv_bytes() - bookkeeping)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_a_ratio_below_the_codecs_sinks_keeps_the_sinks_instead_of_failing():
    """kvzip:ratio=0.5+int4 on a 5-token prompt keeps 3 tokens per layer, fewer than int4's 4 full-precision
    sinks; the per-head ranking then kept too few to hold them and raised ("evicted a codec sink token")."""
    model = _model(HYBRID)
    cache = make_cache("kvzip:ratio=0.5+int4:residual_length=0,group_size=8", model.config)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert full[0].stored_tokens == 4
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("spec,full_kept", [("dynamic:sliding=3", 40), ("kvzip:ratio=0.5,sliding=3", 20),
                                            ("sink_window:sink_tokens=0,window=100,sliding=3", 40)])
def test_sliding_sets_what_the_sliding_layers_keep_whatever_the_budget(spec, full_kept):
    from hf_kvcompress.study import promised_bytes

    model = _model(HYBRID)
    cache = make_cache(spec, model.config)
    assert cache.spec == spec.replace("kvzip:ratio=0.5", "kvzip:ratio=0.5,span=4")  # the hybrid layout's span
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    assert [layer.stored_tokens for layer in cache.layers] == [3, 3, full_kept]
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    if not spec.startswith("kvzip"):  # the study's estimate counts budgets, not ratios
        assert promised_bytes(spec, model.config, 40, 4) == cache.promised_kv_bytes() - 3 * 2 * 8


@pytest.mark.parametrize("spec", ["kvzip:budget=12", "kvzip:budget=12,budgets=layer", "kvzip:budget=12+int8"])
def test_a_kvzip_budget_under_the_window_and_above_prompt_and_answer_evicts_nothing(spec):
    # The sliding layers keep the budget's 12 newest tokens, the full-attention layer ranks the document: 7 + 4
    # tokens fit in both, so the answer is DynamicCache's. The full layer used to stop at the 6 tokens it held at
    # the ranking and evict the document while decoding.
    model = _model(HYBRID)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    logits = [greedy_logits_after_prefill(model, cache, ids) for cache in (
        transformers.DynamicCache(config=model.config), make_cache(spec, model.config))]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["dynamic:sliding=2", "kvzip:ratio=0.5,sliding=3",
                                  "h2o:ratio=0.5,recent=2,sliding=4+int8",
                                  "int4:residual_length=0,group_size=8,key_axis=token", "kvzip:ratio=0.25+int8",
                                  "kvzip:ratio=0.5", "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=0.5,budgets=layer"])
def test_padded_batch_with_shrunk_sliding_layers_matches_rows_alone(spec):
    from .test_contract import _greedy

    model = _model(HYBRID)
    rows, ids, mask = left_padded_prompts(lengths=(5, 23, 19))  # longer than the window: the sliding layers evict
    batched = _greedy(model, ids, mask, make_cache(spec, model.config))
    for i, row in enumerate(rows):
        alone = _greedy(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config))
        assert torch.equal(batched[i], alone[0]), f"row {i} differs with {spec}"


@pytest.mark.parametrize("bad,message", [("dynamic:sliding=0", "sliding must be an integer >= 1"),
                                         ("dynamic:sliding=true", "sliding must be an integer >= 1"),
                                         ("dynamic:sliding=16",
                                          r"sliding=16 is more than this model's sliding layers hold \(15")])
def test_bad_sliding_is_refused_naming_it(bad, message):
    with pytest.raises(ValueError, match=message):
        make_cache(bad, _model(HYBRID).config)


def test_sliding_on_a_model_without_sliding_layers_is_refused():
    from .tiny_models import tiny_model

    with pytest.raises(ValueError, match="sliding=4 sets what sliding-window layers keep, and this model has none"):
        make_cache("dynamic:sliding=4", tiny_model("llama").config)
    from hf_kvcompress import CompressedCache, KeepAllPolicy

    with pytest.raises(ValueError, match="sliding= needs config"):
        CompressedCache(KeepAllPolicy(sliding=4))
