"""Every policy x codec against the cache contract, on tiny random models of several families.

Greedy tokens of random models are fragile (near-ties), so quantized codecs are compared with themselves
(padded batch vs. rows alone) and eviction with large budgets is compared with DynamicCache.
"""

import copy
import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import (
    CompressedCache,
    IntNCodec,
    SinkWindowPolicy,
    make_cache,
    measured_kv_bytes,
    use_kvcompress_attention,
)
from hf_kvcompress.generation import generate, prefill

from .tiny_models import CONFIGS, left_padded_prompts, tiny_model

EVICTING = ["sink_window:sink_tokens=2,window=6", "h2o:budget=8,recent=3", "h2o:budget=8,recent=2,sink_tokens=1+int8",
            "h2o:budget=8,recent=2,sink_tokens=1+int3:residual_length=2,group_size=8,rotate=hadamard,sink_tokens=2",
            "kvzip:budget=8,budgets=uniform+int8"]
SCORED = ["h2o:ratio=0.5,recent=2", "snapkv:budget=8,window=3,recent=2", "snapkv:ratio=0.5,window=3,recent=2",
          "snapkv:ratio=0.5,window=3,recent=2+int8", "tova:ratio=0.5", "keydiff:budget=8+fp8",
          "random:ratio=0.5", "kvzip:ratio=0.5,budgets=uniform", "kvzip:ratio=0.5,budgets=layer",
          "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=0.5", "kvzip:ratio=0.5,span=2",
          "kvzip:budget=8,budgets=head+int4:residual_length=2,group_size=16,rotate=none",
          "expected_attention:ratio=0.5,window=4,sink_tokens=1", "expected_attention:ratio=0.5,sink_tokens=1",
          "expected_attention:ratio=0.5,window=4,sink_tokens=1,decoding=evict",
          "expected_attention:budget=8,window=3,recent=2,sink_tokens=1+int8"]
ALL_SPECS = ["dynamic", "int8", "int4:residual_length=0,group_size=8", "int2:residual_length=4,group_size=8", "fp8",
             *EVICTING, *SCORED, "sink_window:sink_tokens=2,window=6+int4:residual_length=2,group_size=16",
             "int3:residual_length=0,group_size=8,rotate=hadamard,sink_tokens=2",
             "int4:residual_length=0,group_size=8,rotate=hadamard,sink_tokens=2,key_axis=token",
             "int2:residual_length=0,group_size=8,rotate=hadamard,sink_tokens=2,codebook=gaussian",
             "int2:residual_length=4,group_size=8,rotate=hadamard,sink_tokens=2,wide_layers=1",
             "int4:residual_length=0,group_size=8,rotate=per_token,sink_tokens=2"]
# A ratio held at its sinks + recent floor in a short row while a longer row's share grows: the short row must still
# evict at every step (the slot count alone did not say so).
RATIO_AT_FLOOR = ["tova:ratio=0.5,sink_tokens=4", "h2o:ratio=0.5,recent=2,sink_tokens=2"]
LARGE_BUDGET = ["sink_window:sink_tokens=4,window=1000", "h2o:budget=1000,recent=10", "snapkv:budget=1000",
                "tova:ratio=1.0", "kvzip:ratio=1.0,budgets=uniform", "kvzip:ratio=1.0", "kvzip:budget=1000",
                "kvzip:budget=1000,budgets=layer",
                "expected_attention:budget=1000",
                "expected_attention:ratio=1.0"]
REPEAT = [5, 6, 7]  # KVzip's reconstruction prompt, as token ids of the tiny vocabulary


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return use_kvcompress_attention(tiny_model(request.param))


def _greedy(model, ids, mask, cache, new=8, **kwargs):
    return generate(model, ids, mask, cache, max_new_tokens=new, repeat_prompt_ids=REPEAT, **kwargs).new_tokens


@pytest.mark.parametrize("spec", ALL_SPECS + RATIO_AT_FLOOR)
def test_padded_batch_matches_rows_alone(model, spec):
    # Per-channel (KIVI) key groups span group_size token slots shared by the whole batch, so a row equals itself
    # alone only when its padding is a whole number of groups; token-wise codecs have no such condition.
    per_channel = spec.startswith("int") and "residual_length=0" in spec or spec.startswith("int2")
    channel_keys = per_channel and "key_axis=token" not in spec
    rows, ids, mask = left_padded_prompts(lengths=(5, 13, 13) if channel_keys else (5, 13, 9))
    batched = _greedy(model, ids, mask, make_cache(spec, model.config))
    for i, row in enumerate(rows):
        alone = _greedy(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config))
        assert torch.equal(batched[i], alone[0]), f"row {i} differs with {spec}"


@pytest.mark.parametrize("spec", ["kvzip:bytes=0.2", "kvzip:bytes=0.3+int8", "kvzip:bytes=0.6+int4:group_size=16"])
def test_a_byte_target_in_a_padded_batch_matches_rows_alone_and_holds_its_measured_bytes(model, spec):
    """KVzip's `bytes=` (on the hybrid model: sliding windows in int4, plan.py `byte_codecs`) keeps each row's pairs
    as the row alone would, and the cache's measured bytes are the bytes it promises."""
    rows, ids, mask = left_padded_prompts(14, lengths=(5, 13, 9))
    cache = make_cache(spec, model.config)
    batched = _greedy(model, ids, mask, cache)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for i, row in enumerate(rows):
        alone = _greedy(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config))
        assert torch.equal(batched[i], alone[0]), f"row {i} differs with {spec}"


@pytest.mark.parametrize("spec", LARGE_BUDGET)
def test_large_budget_equals_dynamic_cache(model, spec):
    _, ids, mask = left_padded_prompts(1)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits
        out = model(input_ids=ids, attention_mask=mask, cache=make_cache(spec, model.config)).logits
    assert torch.equal(ref, out)
    expected = _greedy(model, ids, mask, DynamicCache(config=model.config), new=10)
    assert torch.equal(_greedy(model, ids, mask, make_cache(spec, model.config), new=10), expected)


@pytest.mark.parametrize("spec", EVICTING)
def test_seq_length_counts_seen_tokens_and_generate_continues(model, spec):
    cache = make_cache(spec, model.config)
    _, ids, mask = left_padded_prompts(2, lengths=(12,))
    first = generate(model, ids, mask, cache, max_new_tokens=5, repeat_prompt_ids=REPEAT)
    assert cache.get_seq_length() == ids.shape[1] + 5 - 1  # the last generated token is not fed back
    kv_length, kv_offset = cache.get_mask_sizes(1, len(cache.layers) - 1)
    layer = cache.layers[-1]
    assert kv_length == layer.stored_tokens + 1 and kv_offset == cache.get_seq_length() - layer.stored_tokens
    before = cache.get_seq_length()
    more = torch.randint(3, 128, (1, 4))
    ids2 = torch.cat([first.sequences, more], dim=1)
    generate(model, ids2, torch.ones_like(ids2), cache, max_new_tokens=3)
    # Only the unseen tokens were processed: the last token of the first answer, the 4 new ones, then 2 decoded.
    assert cache.get_seq_length() == before + 1 + 4 + 2


@pytest.mark.parametrize("spec", ["sink_window:sink_tokens=2,window=6", "h2o:budget=8,recent=3+fp8", EVICTING[-2],
                                  "snapkv:budget=8,window=4,recent=2,decoding=evict+int4:residual_length=2,group_size=16",
                                  "kvzip:budget=8,budgets=uniform+int4:residual_length=2,group_size=16",
                                  "h2o:budget=8,recent=3+int2:residual_length=2,group_size=16,codebook=gaussian",
                                  "expected_attention:budget=8,window=4,recent=2,decoding=evict+int4:residual_length=2,"
                                  "group_size=16"])
def test_memory_is_bounded_and_measured_bytes_match_the_promise(model, spec):
    cache = make_cache(spec, model.config)
    _, ids, mask = left_padded_prompts(3, lengths=(40,))
    chunk = None if spec.startswith("kvzip") else 5  # KVzip holds the context until its reconstruction pass
    generate(model, ids, mask, cache, max_new_tokens=6, prefill_chunk_size=chunk, repeat_prompt_ids=REPEAT)
    budget = cache.policy.budget
    for layer in cache.layers:
        if not layer.is_sliding:
            assert layer.stored_tokens == budget
            assert layer.peak_tokens <= (budget + 5 if chunk else 2 * 40 + len(REPEAT))
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("spec", ["snapkv:budget=8,window=4,recent=2",
                                  "snapkv:ratio=0.25,window=4,recent=2+int4:residual_length=2,group_size=16"])
def test_snapkv_compresses_the_prompt_and_appends_what_it_generates(model, spec):
    # SnapKV's default (the paper's): each prompt chunk is scored and evicted, decode steps only append.
    cache = make_cache(spec, model.config)
    _, ids, mask = left_padded_prompts(3, lengths=(40,))
    generate(model, ids, mask, cache, max_new_tokens=6, prefill_chunk_size=5)
    # generate() feeds the prompt's last token as a step of its own after the chunks: it is appended as generated.
    chunked = ids.shape[1] - 1
    kept = 8 if cache.policy.budget else math.ceil(chunked * 0.25)
    for layer in cache.layers:
        if not layer.is_sliding:
            assert layer.stored_tokens == kept + layer.get_seq_length() - chunked
            assert layer.get_max_length() == -1
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=4,group_size=8",
                                  "sink_window:sink_tokens=2,window=6"])
def test_reset_and_reuse_give_the_same_answer(model, spec):
    cache = make_cache(spec, model.config)
    _, ids, mask = left_padded_prompts(4, lengths=(9, 11))
    first = _greedy(model, ids, mask, cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(_greedy(model, ids, mask, cache), first)


def test_beam_search_and_sampling_match_dynamic_cache_with_large_budget(model):
    _, ids, mask = left_padded_prompts(5, lengths=(7, 10))
    spec = LARGE_BUDGET[0]
    for kwargs in ({"num_beams": 2}, {"do_sample": True, "top_k": 5}):
        torch.manual_seed(0)
        ref = _greedy(model, ids, mask, DynamicCache(config=model.config), **kwargs)
        torch.manual_seed(0)
        out = _greedy(model, ids, mask, make_cache(spec, model.config), **kwargs)
        assert torch.equal(ref, out), kwargs


def test_beam_search_runs_with_eviction(model):
    _, ids, mask = left_padded_prompts(6, lengths=(12,))
    out = _greedy(model, ids, mask, make_cache(EVICTING[0], model.config), num_beams=3)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=2,group_size=16", "kvzip:ratio=0.5"])
def test_beams_over_a_prefilled_cache_after_repeating_its_rows(spec):
    # generate() expands the rows for beams but not a cache that was prefilled (transformers' DynamicCache fails
    # there too): the error names batch_repeat_interleave, and after it the beams equal beams over the whole prompt.
    model = use_kvcompress_attention(tiny_model("llama"))
    _, ids, mask = left_padded_prompts(7, lengths=(14,))
    context = ids[:, :-3]
    cache = make_cache(spec, model.config)
    prefill(model, context, None, cache, repeat_prompt_ids=REPEAT)
    with pytest.raises(ValueError, match=r"batch_repeat_interleave\(2\)"):
        model.generate(ids, attention_mask=mask, cache=cache, num_beams=2, max_new_tokens=4, do_sample=False)
    cache = make_cache(spec, model.config)
    prefill(model, context, None, cache, repeat_prompt_ids=REPEAT)
    cache.batch_repeat_interleave(2)
    out = model.generate(ids, attention_mask=mask, cache=cache, num_beams=2, max_new_tokens=4, do_sample=False)
    whole = model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=4, do_sample=False)
    if spec == "dynamic":
        assert torch.equal(out, whole)
    assert out.shape == whole.shape


def test_crop_works_until_something_is_evicted():
    model = tiny_model("llama")
    _, ids, _ = left_padded_prompts(7, lengths=(10,))
    cache = make_cache("int8:residual_length=4", model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    evicting = make_cache("sink_window:sink_tokens=1,window=4", model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=evicting)
    with pytest.raises(ValueError, match="evicted"):
        evicting.crop(-2)


def test_cache_reused_on_a_different_model_is_refused():
    cache = make_cache("int8")
    _, ids, _ = left_padded_prompts(8, lengths=(6,))
    with torch.no_grad():
        tiny_model("llama")(input_ids=ids, cache=cache)
        with pytest.raises(ValueError, match="KV heads"):
            tiny_model("mistral")(input_ids=ids, cache=cache)
    # A cache built from a 3-layer config refuses a deeper model.
    cache = make_cache("int8", tiny_model("gemma3").config)
    with pytest.raises(ValueError, match="3 layers"):
        cache.update(torch.zeros(1, 1, 1, 32), torch.zeros(1, 1, 1, 32), 5)


def test_heavy_hitter_without_statistics_says_how_to_enable_them():
    model = tiny_model("llama")  # plain SDPA, not the statistics-gathering attention
    # Built from a copy of the config, the cache cannot switch the model to its attention (CompressedCache).
    cache = make_cache("h2o:budget=8,recent=2", copy.deepcopy(model.config))
    _, ids, mask = left_padded_prompts(9, lengths=(6,))
    with pytest.raises(RuntimeError, match="use_kvcompress_attention"):
        generate(model, ids, mask, cache, max_new_tokens=3)


def test_generate_with_chunked_prefill_never_holds_more_than_sinks_window_and_one_chunk():
    from hf_kvcompress import SinkWindowCache

    model = tiny_model("llama")
    cache = SinkWindowCache(sink_tokens=2, window=8, config=model.config)
    ids = torch.randint(3, 128, (1, 60))
    model.generate(input_ids=ids, cache=cache, prefill_chunk_size=7, max_new_tokens=5, do_sample=False)
    assert cache.get_seq_length() == 64
    for layer in cache.layers:
        assert layer.stored_tokens == 10 and layer.peak_tokens <= 10 + 7


def test_rerotate_keeps_exact_output_before_eviction_and_compresses_positions_after():
    from hf_kvcompress import SinkWindowCache

    model = tiny_model("llama")
    _, ids, mask = left_padded_prompts(10, lengths=(9, 14))
    big = SinkWindowCache(sink_tokens=2, window=100, config=model.config, rerotate=True)
    assert torch.equal(_greedy(model, ids, mask, big), _greedy(model, ids, mask, DynamicCache(config=model.config)))
    small = SinkWindowCache(sink_tokens=2, window=6, config=model.config, rerotate=True)
    _greedy(model, ids, mask, small)
    layer = small.layers[0]
    # Each row's kept keys now sit at the positions just before its next query: real_seen - 8 ... real_seen - 1.
    expected = layer.real_seen[:, None] - 8 + torch.arange(8)
    assert torch.equal(layer.positions[:, 0].long(), expected)
    with pytest.raises(ValueError, match="config"):
        SinkWindowCache(rerotate=True)
    with pytest.raises(ValueError, match="full-precision"):
        CompressedCache(SinkWindowPolicy(), IntNCodec(bits=4), model.config, rerotate=True)


@pytest.mark.parametrize("spec", ["dynamic", "fp8", "int8", "sink_window:sink_tokens=2,window=100"])
def test_prefill_stores_owned_tensors_not_views_of_a_fused_projection(model, spec):
    # GPT-2 and Phi-3 compute K and V as slices of one fused QKV output; keeping those views pins the whole buffer.
    cache = make_cache(spec, model.config)
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_explicit_channel_keys_on_a_hybrid_model_apply_to_every_layer():
    # Sliding layers keep per-channel keys too, dropping whole key groups as the window passes them.
    model = tiny_model("gemma3")
    cache = make_cache("int4:key_axis=channel,residual_length=0,group_size=8", model.config)
    axes = [(layer.is_sliding, layer.codec.key_axis) for layer in cache.layers]
    assert axes == [(True, "channel"), (True, "channel"), (False, "channel")]
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(12))
    out = generate(model, ids, None, cache, max_new_tokens=4)
    assert out.new_tokens.shape == (1, 4)
    window = model.config.sliding_window - 1
    assert all(window <= layer.stored_tokens <= window + 7 for layer in cache.layers if layer.is_sliding)
    with pytest.raises(ValueError, match="key_axis"):
        make_cache("sink_window:window=8+int4:key_axis=channel", model.config)


@pytest.mark.parametrize("spec", ["h2o:ratio=0.25,recent=2", "kvzip:ratio=0.25,budgets=uniform",
                                  "sink_window:ratio=0.25+int8",
                                  "expected_attention:ratio=0.25,window=8,decoding=evict"])
def test_ratio_keeps_its_share_after_prefill_and_while_decoding(spec):
    model = use_kvcompress_attention(tiny_model("llama"))
    _, ids, mask = left_padded_prompts(11, lengths=(40,))
    cache = make_cache(spec, model.config)
    prefill(model, ids, mask, cache, repeat_prompt_ids=REPEAT)
    assert [layer.stored_tokens for layer in cache.layers] == [10, 10]  # a quarter of 40
    generate(model, torch.cat([ids, ids[:, :9]], 1), None, cache, max_new_tokens=4)
    assert cache.get_seq_length() == 52 and [layer.stored_tokens for layer in cache.layers] == [13, 13]
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_kvzip_compresses_once_and_answers_several_questions():
    import copy

    model = use_kvcompress_attention(tiny_model("llama"))
    _, document, _ = left_padded_prompts(12, lengths=(30,))
    cache = make_cache("kvzip:ratio=0.5", model.config)
    prefill(model, document, None, cache, repeat_prompt_ids=REPEAT)
    assert cache.get_seq_length() == 30  # half of the pairs of every layer and head, wherever they rank best:
    assert sum(int(layer.store.held_pairs()[0]) for layer in cache.layers) == 15 * model.config.num_key_value_heads * 2
    answers = []
    for question in ([9, 10, 11], [12, 13, 14]):
        asked = copy.deepcopy(cache)
        ids = torch.cat([document, torch.tensor([question])], dim=1)
        answers.append(generate(model, ids, None, asked, max_new_tokens=4).new_tokens)
        assert asked.get_seq_length() == 30 + 3 + 4 - 1
    assert cache.get_seq_length() == 30  # the compressed document is untouched
    with pytest.raises(ValueError, match="repeat_prompt_ids"):
        prefill(model, document, None, make_cache("kvzip:ratio=0.5", model.config))
    with pytest.raises(ValueError, match="already holds"):
        prefill(model, document[:, :3], None, cache, repeat_prompt_ids=REPEAT)
    with pytest.raises(RuntimeError, match="hf_kvcompress.prefill"):  # model.generate alone never compresses
        model.generate(input_ids=document, cache=make_cache("kvzip:budget=8", model.config), max_new_tokens=2)


def test_ratio_in_a_padded_batch_without_our_attention_is_refused():
    # A padded row that keeps a share of its tokens and some padding needs the layer's own mask, which only the
    # package's attention function reads; plain SDPA would silently attend with transformers' misplaced mask.
    model = tiny_model("llama")
    _, ids, mask = left_padded_prompts(13, lengths=(5, 13))
    with pytest.raises(RuntimeError, match="use_kvcompress_attention"):
        generate(model, ids, mask, make_cache("keydiff:ratio=0.5", copy.deepcopy(model.config)), max_new_tokens=3)
