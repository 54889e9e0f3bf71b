"""KVzip's head budgets: one ranking of every (layer, KV head, token) pair, each head's kept pairs stored compactly."""

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.caches.head_store import EVICTION_SLACK, SLACK_SHARE, HeadStore, RaggedHeads
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.caches.requests import MASK_KEY
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.hf.compat import cache_kwargs
from hf_kvcompress.ops.host_syncs import HostSyncCounter
from hf_kvcompress.registry import parse_spec

from .tiny_models import kvzip_forced_logits, left_padded, masked_reference_logits, tiny_model

REPEAT = [5, 6, 7]


def _exact_pairs(spec, config):
    """The cache of `spec` by the ratio's own plan: exact pairs, whose ranking these tests compare with a reference
    (a plain KVzip ratio below a half is otherwise its byte target, in int4: caches/plan.py `ratio_as_bytes`)."""
    return CompressedCache(*parse_spec(spec), config=config, ratio_bytes=False)


def _ids(n, seed=16, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _scored(model, ids, mask=None):
    """A cache that kept everything, its reconstruction scores readable."""
    cache = make_cache("kvzip:ratio=1.0,budgets=uniform", model.config)
    prefill(model, ids, mask, cache, repeat_prompt_ids=REPEAT)
    return cache


def _reference_keep(scores, share, heads, sinks=0):
    """Plain global ranking of one row: the top `share x heads x layers` pairs over all layers and heads."""
    protected = [s.clone() for s in scores]
    for s in protected:
        s[..., :sinks] = float("inf")
    flat = torch.cat([s.flatten() for s in protected])
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept[flat.sort(descending=True, stable=True).indices[: share * heads * len(scores)]] = True
    return list(kept.split([s.numel() for s in scores]))


def test_ragged_store_views_evicts_appends_and_selects_rows_like_a_plain_reference():
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 7, 4
    states = torch.randn(B, H, T, D, generator=g)
    scores = torch.rand(B, H, T, generator=g)
    keep = torch.rand(B, H, T, generator=g) > 0.4
    codec = IdentityCodec()
    store = RaggedHeads.pack({"states": states}, {"states": -states}, scores, keep)
    assert torch.equal(store.lengths, keep.sum(-1)) and store.pairs == int(keep.sum())
    view, valid = store.padded(codec, "key", torch.float32), store.valid()
    for b in range(B):
        for h in range(H):
            n = int(keep[b, h].sum())
            assert torch.equal(view[b, h, store.most - n :], states[b, h][keep[b, h]])  # right-aligned, in order
            assert valid[b, h].sum() == n and bool(valid[b, h, store.most - n :].all())
    # Evicting: each row loses its lowest-scored pairs, whatever head holds them.
    store.evict_lowest([3, 1])
    for b, k in enumerate([3, 1]):
        row = scores[b][keep[b]]
        survivors = sorted(row.tolist())[k:]
        held = store.padded(codec, "key", torch.float32)[b][store.valid()[b]]
        expected = states[b][keep[b] & (scores[b] >= min(survivors))]
        assert torch.equal(held, expected)
    # Appending newer pairs puts them after each head's pairs; selecting rows reorders them.
    lengths = store.lengths.clone()
    fresh = torch.randn(B, H, 2, D, generator=g)
    store.append({"states": fresh}, {"states": -fresh}, torch.full((B, H, 2), 5.0),
                 torch.ones(B, H, 2, dtype=torch.bool))
    assert torch.equal(store.lengths, lengths + 2)
    view = store.padded(codec, "key", torch.float32)
    assert torch.equal(view[..., -2:, :], fresh)
    partial = torch.tensor([True, False])[None, None, :].expand(B, H, 2)  # only the first of two newer pairs
    store.append({"states": fresh}, {"states": -fresh}, torch.full((B, H, 2), 6.0), partial)
    assert torch.equal(store.lengths, lengths + 3)
    assert torch.equal(store.padded(codec, "key", torch.float32)[..., -3:, :], torch.cat([fresh, fresh[..., :1, :]], 2))
    before = store.padded(codec, "value", torch.float32)
    store.select_rows(torch.tensor([1, 1, 0]))
    assert torch.equal(store.padded(codec, "value", torch.float32)[:, :, -before.shape[2]:], before[[1, 1, 0]])


def test_head_budgets_keep_each_rows_best_pairs_of_all_layers_and_heads():
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(40)
    scores = [layer.accumulated[0] for layer in _scored(model, ids).layers]  # [H, 40] per layer
    heads = scores[0].shape[0]
    expected = _reference_keep(scores, 10, heads)  # a quarter of 40 tokens per head, on average

    cache = _exact_pairs("kvzip:ratio=0.25,budgets=head,span=0", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    assert all(isinstance(layer.store, HeadStore) for layer in cache.layers)
    lengths = [layer.store.encoded.lengths[0] for layer in cache.layers]
    assert [per_layer.tolist() for per_layer in lengths] == [e.view(heads, -1).sum(-1).tolist() for e in expected]
    # Heads really keep different numbers of pairs.
    assert len({n for per_layer in lengths for n in per_layer.tolist()}) > 1
    assert sum(int(per_layer.sum()) for per_layer in lengths) == 10 * heads * len(scores)
    assert cache.stored_tokens == 10  # what `generate` reports per layer: the mean of the layers' shares
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    # The memory follows the pairs kept, not the head that keeps the most.
    uniform = make_cache("kvzip:ratio=0.25,budgets=uniform", model.config)
    prefill(model, ids, None, uniform, repeat_prompt_ids=REPEAT)
    assert measured_kv_bytes(cache) <= measured_kv_bytes(uniform) * 1.05


def test_span_chooses_which_pairs_each_head_keeps_but_not_how_many():
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(40)
    scores = [layer.accumulated[0] for layer in _scored(model, ids).layers]
    heads = scores[0].shape[0]
    counts = [e.view(heads, -1).sum(-1) for e in _reference_keep(scores, 10, heads)]
    cache = _exact_pairs("kvzip:ratio=0.25,span=3", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    for layer, s, n in zip(cache.layers, scores, counts, strict=True):
        assert torch.equal(layer.store.encoded.lengths[0], n)
        spanned = torch.stack([s[:, t : t + 4].amax(-1) for t in range(40)], dim=-1)
        held = layer.store.encoded.scores.split(n.tolist())  # flat, head by head, oldest first
        for h in range(heads):
            kept = spanned[h].sort(descending=True, stable=True).indices[: int(n[h])].sort().values
            assert torch.equal(held[h], spanned[h, kept])
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_span_0_keeps_kvzips_own_ranking_of_every_pair():
    """`kvzip:ratio=R,span=0` keeps exactly the pairs of one ranking of the raw reconstruction scores (KVzip's rule,
    and kvpress's KVzipPress's without its sinks): no span re-chooses them (span 4, the default, does)."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(40)
    scores = [layer.accumulated[0] for layer in _scored(model, ids).layers]
    heads = scores[0].shape[0]
    expected = _reference_keep(scores, 10, heads)
    cache = _exact_pairs("kvzip:ratio=0.25,span=0", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    for layer, s, e in zip(cache.layers, scores, expected, strict=True):
        mask = e.view(heads, -1)
        n = mask.sum(-1)
        assert torch.equal(layer.store.encoded.lengths[0], n)
        held = layer.store.encoded.scores.split(n.tolist())  # flat, head by head, oldest first
        for h in range(heads):
            assert torch.equal(held[h], s[h, mask[h]])


def _ranked_beside_reference(spec):
    """A tiny Llama, a 30-token prompt ranked by `spec` (ratio 0.4: 12 pairs per head) and, beside it, the full
    scored cache with the plain reference's kept pairs per layer (`_reference_keep`)."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids, question = _ids(30, seed=3), _ids(4, seed=4)
    scored = _scored(model, ids)
    expected_keep = _reference_keep([layer.accumulated[0] for layer in scored.layers], 12, 2)
    cache = _exact_pairs(spec, model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    return model, question, scored, expected_keep, cache


def test_head_budget_attention_equals_the_full_cache_with_each_heads_evicted_pairs_masked():
    model, question, scored, expected_keep, cache = _ranked_beside_reference("kvzip:ratio=0.4,budgets=head,span=0")
    with torch.inference_mode():
        out = model(input_ids=question, cache=cache, position_ids=torch.arange(30, 34)[None]).logits
    masks = {i: keep.view(2, 30) for i, keep in enumerate(expected_keep)}
    (ref,) = masked_reference_logits(model, scored, [question], masks, start=30)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_append_decodes_as_the_full_cache_with_the_rankings_evicted_pairs_masked():
    # KVzip's default decoding="append" (kvpress's KVzipPress: masks the ranking's evicted pairs, evicts nothing
    # later): a question and the answer's steps attend over exactly the ranked pairs plus every later token.
    model, question, scored, expected_keep, cache = _ranked_beside_reference("kvzip:ratio=0.4,span=0")
    ranked = [int(layer.store.held_pairs()[0]) for layer in cache.layers]
    steps = [question] + [_ids(1, seed=20 + i) for i in range(8)]  # the question, then 8 decode steps
    outs, position = [], 30
    with torch.inference_mode():
        for step in steps:
            where = torch.arange(position, position + step.shape[1])[None]
            outs.append(model(input_ids=step, cache=cache, position_ids=where).logits)
            position += step.shape[1]
    masks = {i: keep.view(2, 30) for i, keep in enumerate(expected_keep)}
    refs = masked_reference_logits(model, scored, steps, masks, start=30)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    later = sum(step.shape[1] for step in steps)
    for layer, pairs in zip(cache.layers, ranked, strict=True):  # every ranked pair and every later token held
        assert int(layer.store.held_pairs()[0]) == pairs + later * layer.kv_heads
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_evict_gives_the_question_the_documents_lowest_pairs():
    # decoding="evict": the ratio holds over the question's tokens too, so the cache no longer equals the masked
    # reference above once a question arrives: what it holds is the allowance (less the slack), not ranked + later.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(200, seed=3)
    held = {}
    for decoding in ("append", "evict"):
        cache = make_cache(f"kvzip:ratio=0.25,decoding={decoding}", model.config)
        generate(model, ids, None, cache, max_new_tokens=1, repeat_prompt_ids=REPEAT)
        ranked = [int(layer.store.held_pairs()[0]) for layer in cache.layers]
        generate(model, torch.cat([ids, _ids(40, seed=5)], 1), None, cache, max_new_tokens=1)
        held[decoding] = [int(layer.store.held_pairs()[0]) - pairs for layer, pairs in zip(cache.layers, ranked,
                                                                                          strict=True)]
    heads = cache.layers[0].kv_heads
    assert held["append"] == [40 * heads] * len(cache.layers)
    assert all(h < 40 * heads * 0.25 + heads for h in held["evict"])


def test_decoding_is_checked_and_append_needs_head_budgets():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="decoding must be one of append, evict"):
        make_cache("kvzip:ratio=0.5,decoding=keep", model.config)
    with pytest.raises(ValueError, match="decoding='append' keeps what the ranking of every pair kept"):
        make_cache("kvzip:ratio=0.5,budgets=layer,decoding=append", model.config)
    assert make_cache("kvzip:ratio=0.5", model.config).policy.resolved_decoding == "append"
    assert make_cache("kvzip:ratio=0.5,budgets=token", model.config).policy.resolved_decoding == "evict"


@pytest.mark.parametrize("spec", ["kvzip:budget=10,budgets=head,decoding=evict",
                                  "kvzip:ratio=0.25,budgets=head,decoding=evict+int4:residual_length=2,group_size=16",
                                  "kvzip:ratio=0.5,budgets=head,decoding=evict+fp8"])
def test_decoding_holds_the_allowance_context_first_and_bytes_match_the_promise(spec):
    model = use_kvcompress_attention(tiny_model("qwen2"))
    ids = _ids(40, seed=5)
    cache = make_cache(spec, model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    layers = cache.layers
    at_ranking = [int(layer.store.held_pairs()[0]) for layer in layers]
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    generate(model, torch.cat([ids, _ids(6, seed=6)], 1), None, cache, max_new_tokens=40)
    assert cache.get_seq_length() == 40 + 6 + 39
    kv_length, kv_offset = cache.get_mask_sizes(1, 0)  # what transformers sizes its mask by: the padded view + 1
    view = layers[0].store.view_tokens
    assert kv_length == view + 1 and kv_offset == cache.get_seq_length() - view
    for layer, start in zip(layers, at_ranking, strict=True):
        held = int(layer.store.held_pairs()[0])
        store = layer.store
        allowance = start + int(layer.kv_heads * (cache.policy.held_per_row(store.real_seen) - store.share_then)[0])
        # Eviction goes down to the allowance less the slack (stored pairs), or drops whole older recent tokens
        # (every head of a row at once) once the store has nothing left to give: never above the allowance.
        slack = min(allowance // SLACK_SHARE, EVICTION_SLACK * layer.kv_heads)
        assert allowance - slack - layer.kv_heads < held <= allowance
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def _allowance(cache, layer) -> int:
    """Pairs row 0 of `layer` may hold now: its share at the ranking, moved by the policy's share since."""
    store = layer.store
    return int((store.allowance + layer.kv_heads * (cache.policy.held_per_row(store.real_seen) - store.share_then))[0])


def test_decoding_evicts_a_block_at_a_time_and_never_holds_more_than_the_allowance():
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(600, seed=12)
    cache = make_cache("kvzip:ratio=0.5,decoding=evict", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    held = [[int(layer.store.held_pairs()[0])] for layer in cache.layers]
    # The ranking: exactly.
    assert all(h[0] == _allowance(cache, layer) for h, layer in zip(held, cache.layers, strict=True))
    token = ids[:, -1:]
    with torch.inference_mode():
        for _ in range(80):
            token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            for h, layer in zip(held, cache.layers, strict=True):
                h.append(int(layer.store.held_pairs()[0]))
                assert h[-1] <= _allowance(cache, layer)
    for h, layer in zip(held, cache.layers, strict=True):
        evicted = [before + layer.kv_heads - after for before, after in zip(h, h[1:], strict=False)
                   if after < before + layer.kv_heads]
        # A ratio of a half grows the allowance by a pair per head every other token while each token adds one:
        # evicting only the excess would run 40 times here; with the slack (64 pairs of 300 x 2) it runs twice.
        assert len(evicted) == 2 and all(n > EVICTION_SLACK * layer.kv_heads for n in evicted)


def _held_pairs(layer, b, h, kind):
    """What head h of row b holds, read from the flat store, the sinks and the recent tokens (no padded view)."""
    pairs = layer.store.encoded
    ends = pairs.lengths.flatten().cumsum(0).tolist()
    i = b * layer.kv_heads + h
    start = ends[i - 1] if i else 0
    encoded = {n: t[start : ends[i]][None, None] for n, t in (pairs.keys if kind == "key" else pairs.values).items()}
    parts = [layer.codec.decode(encoded, kind, torch.float32)[0, 0]]
    if layer.store.exact is not None:  # the context's pairs still within the codec's residual, as they are
        ends = layer.store.exact.lengths.flatten().cumsum(0).tolist()
        start = ends[i - 1] if i else 0
        exact = layer.store.exact
        parts.append((exact.keys if kind == "key" else exact.values)["states"][start : ends[i]].float())
    if layer.store.sink_valid is not None:
        sinks = layer.sink_keys if kind == "key" else layer.sink_values
        parts.insert(0, sinks[b, h][layer.store.sink_valid[b]].float())
    if layer.store.tail_valid is not None:
        parts.append((layer.tail_keys if kind == "key" else layer.tail_values)[b, h][layer.store.tail_valid[b]])
    return torch.cat(parts)


@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5,decoding=evict",
                                  "kvzip:ratio=0.5,decoding=evict+int4:residual_length=2,group_size=16",
                                  "kvzip:ratio=0.5,decoding=evict+int4:residual_length=40,group_size=16",
                                  "kvzip:ratio=0.5", "kvzip:ratio=0.5+int4:residual_length=2,group_size=16"])
def test_each_decode_step_attends_over_exactly_the_pairs_each_head_holds(spec, monkeypatch):
    # The padded view and mask (the reference of the faster decode steps, which test_head_store_kernel.py and the
    # tests below check against it): lossy stores would otherwise be read by the C++ kernel once the prompt's
    # steps have confirmed our attention.
    monkeypatch.setattr(HeadStore, "attends_encoded", property(lambda self: False))
    model = use_kvcompress_attention(tiny_model("llama"))
    rows = [_ids(300, seed=13)[0], _ids(260, seed=14)[0]]
    ids, mask = torch.zeros(2, 300, dtype=torch.long), torch.zeros(2, 300, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 300 - len(row) :], mask[i, 300 - len(row) :] = row, 1
    cache = make_cache(spec, model.config)
    prefill(model, ids, mask, cache, repeat_prompt_ids=REPEAT)
    layer = cache.layers[1]
    g = torch.Generator().manual_seed(1)
    scale = layer.head_dim**-0.5
    evictions = 0
    for _ in range(70):  # crosses blocks of recent tokens joining the store, and evictions
        key, value, query = (torch.randn(2, layer.kv_heads, 1, layer.head_dim, generator=g) for _ in range(3))
        held = [[(_held_pairs(layer, b, h, "key"), _held_pairs(layer, b, h, "value")) for h in range(layer.kv_heads)]
                for b in range(2)]
        pairs_before = layer.store.encoded.pairs
        kwargs = {}
        keys, values = layer.update(key, value, kwargs)
        allowed = kwargs[MASK_KEY].mask
        kwargs[MASK_KEY].used = True
        evictions += layer.store.encoded.pairs < pairs_before
        for b in range(2):
            for h in range(layer.kv_heads):
                logits = (keys[b, h] @ query[b, h, 0]) * scale
                out = torch.softmax(logits.masked_fill(~allowed[b, h, 0], float("-inf")), -1) @ values[b, h]
                k, v = (torch.cat([held[b][h][j], s[b, h]]) for j, s in enumerate((key, value)))
                expected = torch.softmax((k @ query[b, h, 0]) * scale, -1) @ v
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert evictions >= 2 if "decoding=evict" in spec else evictions == 0  # append: nothing after the ranking


def test_budget_spent_by_the_answer_evicts_the_oldest_later_tokens_too():
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("kvzip:budget=6,budgets=head,decoding=evict", model.config)
    ids = _ids(12, seed=7)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    layers = cache.layers
    allocated = [int(layer.store.held_pairs()[0]) for layer in layers]
    assert sum(allocated) == 6 * layers[0].kv_heads * len(layers)
    generate(model, torch.cat([ids, _ids(2, seed=1)], 1), None, cache, max_new_tokens=30)  # many more than the budget
    for layer, pairs in zip(layers, allocated, strict=True):
        assert pairs - pairs // SLACK_SHARE - layer.kv_heads < int(layer.store.held_pairs()[0]) <= pairs
        scores = layer.store.encoded.scores
        assert int(torch.isfinite(scores).sum()) == 0 or scores.min() >= 2.0  # context gone
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def _decode_logits(model, ids, mask, cache, new_tokens):
    """Greedy logits [B, new, V] of model.generate over `cache`, prefilled first by KVzip's pass (but a
    DynamicCache)."""
    with torch.inference_mode():  # prefill runs in inference mode: so must the steps that update its tensors
        if not isinstance(cache, DynamicCache):
            prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=REPEAT)
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1)


def _real_tokens_held(layer) -> list[int]:
    """Real tokens per KV head each row holds (with head budgets: pairs over the heads)."""
    if isinstance(layer.store, HeadStore):
        return (layer.store.held_pairs() // layer.kv_heads).tolist()
    return (layer.stored_tokens - layer.pads).tolist()


@pytest.mark.parametrize("spec", ["kvzip:budget=100", "kvzip:budget=100,budgets=layer"])
def test_a_budget_above_prompt_and_answer_keeps_every_token_alone_and_padded(spec):
    # 27 (or 40) tokens + 12 new ones stay under the budget of 100: the cache must hold every token and answer as
    # DynamicCache. The head layer's allowance stood at the pairs held at the ranking, and budgets=layer set each
    # layer's budget to the tokens it held then (padding slots counted in a padded row), so decoding evicted the
    # document one token per step.
    model = use_kvcompress_attention(tiny_model("llama"))
    rows = [_ids(27, seed=3)[0], _ids(40, seed=4)[0]]
    for batch in ([rows[0]], rows):
        ids, mask = left_padded(batch)
        expected = _decode_logits(model, ids, mask, DynamicCache(), 12)
        cache = make_cache(spec, model.config)
        torch.testing.assert_close(_decode_logits(model, ids, mask, cache, 12), expected, rtol=1e-4, atol=1e-4)
        for layer in cache.layers:  # every token seen (the last new one is not fed back)
            assert _real_tokens_held(layer) == [len(row) + 11 for row in batch]


@pytest.mark.parametrize("spec", ["kvzip:budget=30,decoding=evict", "kvzip:budget=30,budgets=layer"])
def test_a_budget_above_the_prompt_fills_up_with_later_tokens_and_stops_at_the_budget(spec):
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(20, seed=5)
    cache = make_cache(spec, model.config)
    generate(model, ids, None, cache, max_new_tokens=40, repeat_prompt_ids=REPEAT)
    for layer in cache.layers:
        held = _real_tokens_held(layer)[0]
        if isinstance(layer.store, HeadStore):  # evicted down to the budget less the slack: never above it
            assert 30 - 30 // SLACK_SHARE - 1 <= held <= 30
        else:
            assert held == 30


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_a_context_within_the_codecs_residual_stays_at_full_precision(codec):
    # 39 context tokens, under int4/int8's residual of 128: nothing is quantized, as with budgets=uniform, so the
    # answer is DynamicCache's. The ranking used to encode every kept pair of the context into the store.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(40, seed=1)
    mask = torch.ones_like(ids)
    expected = _decode_logits(model, ids, mask, DynamicCache(), 8)
    cache = make_cache(f"kvzip:ratio=1.0+{codec}", model.config)
    torch.testing.assert_close(_decode_logits(model, ids, mask, cache, 8), expected, rtol=1e-5, atol=1e-5)
    assert all(layer.store.encoded.pairs == 0 for layer in cache.layers)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


def test_the_contexts_exact_pairs_join_the_store_once_later_tokens_fill_the_residual():
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("kvzip:ratio=1.0+int4:residual_length=8,group_size=16,sink_tokens=0", model.config)
    ids = _ids(30, seed=2)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    heads = cache.layers[0].kv_heads
    # The scored layer had encoded 22 tokens and held the newest 8 at full precision: so does each head now.
    assert all((layer.store.encoded.pairs, layer.store.exact.pairs) == (22 * heads, 8 * heads)
               for layer in cache.layers)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    token = ids[:, -1:]
    with torch.inference_mode():
        for step in range(1, 9):
            token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                assert int(layer.store.held_pairs()[0]) == (30 + step) * heads  # ratio 1.0: nothing evicted
                # 7 later tokens leave the context's newest token within the residual; the 8th fills it.
                assert (layer.store.exact is None) == (step == 8)
            assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert all(layer.store.encoded.pairs == 30 * heads for layer in cache.layers)


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])
def test_padded_rows_equal_rows_alone(name):
    model = use_kvcompress_attention(tiny_model(name))
    _assert_padded_rows_decode_as_alone(model, [_ids(n, seed=8 + n)[0] for n in (9, 16)],
                                        "kvzip:ratio=0.5,budgets=head+int8", new_tokens=6)


def _assert_padded_rows_decode_as_alone(model, rows, spec, new_tokens):
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    batched = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=new_tokens,
                       repeat_prompt_ids=REPEAT).new_tokens
    for i, row in enumerate(rows):
        alone = generate(model, row[None], None, make_cache(spec, model.config), max_new_tokens=new_tokens,
                         repeat_prompt_ids=REPEAT).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i}"


def test_padded_rows_evicting_in_blocks_at_different_steps_equal_rows_alone():
    # Rows of 300 and 200 tokens: their allowances, slacks and eviction steps differ; each must decode as alone.
    model = use_kvcompress_attention(tiny_model("llama"))
    _assert_padded_rows_decode_as_alone(model, [_ids(300, seed=15)[0], _ids(200, seed=16)[0]],
                                        "kvzip:ratio=0.5,decoding=evict", new_tokens=80)


# int4: the padded view; full precision: decode steps over each head's own pairs (`HeadStore.attend`)
@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5,budgets=head+int4:residual_length=2,group_size=16",
                                  "kvzip:ratio=0.5"])
def test_save_load_reset_and_beams(tmp_path, spec):
    from hf_kvcompress import load_cache, save_cache

    model = use_kvcompress_attention(tiny_model("llama"))
    ids, question = _ids(24, seed=9), _ids(3, seed=10)
    cache = make_cache(spec, model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path)
    full = torch.cat([ids, question], 1)
    expected = generate(model, full, None, copy.deepcopy(cache), max_new_tokens=5).new_tokens
    loaded = load_cache(path)
    assert isinstance(loaded.layers[0].store, HeadStore)
    assert torch.equal(generate(model, full, None, loaded, max_new_tokens=5).new_tokens, expected)
    # What beam search does to a cache: repeat each row, then reorder the rows.
    repeated = copy.deepcopy(cache)
    repeated.batch_repeat_interleave(2)
    repeated.reorder_cache(torch.tensor([1, 0]))
    both = generate(model, full.repeat(2, 1), None, repeated, max_new_tokens=5).new_tokens
    assert torch.equal(both, expected.repeat(2, 1))
    cache.reset()
    assert all(isinstance(layer, CompressedLayer) and layer.store is None for layer in cache.layers)
    assert cache.get_seq_length() == 0
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    assert torch.equal(generate(model, full, None, cache, max_new_tokens=5).new_tokens, expected)


def test_bad_combinations_are_refused_with_the_reason():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="budgets must be one of uniform, layer, head"):
        make_cache("kvzip:budgets=heads", model.config)
    with pytest.raises(ValueError, match="stores one head"):
        make_cache("kvzip:ratio=0.5,budgets=head+shared_heads", model.config)
    cache = make_cache("kvzip:ratio=0.5,budgets=head", model.config)
    use_kvcompress_attention(model)
    prefill(model, _ids(20), None, cache, repeat_prompt_ids=REPEAT)
    model.set_attn_implementation("sdpa")  # plain SDPA would ignore the per-head mask
    with pytest.raises(RuntimeError, match="use_kvcompress_attention"):
        generate(model, _ids(22), None, cache, max_new_tokens=3)


def test_recent_tokens_of_the_document_are_kept_and_later_give_way_before_later_tokens():
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(40, seed=11)
    cache = make_cache("kvzip:budget=10,recent=4", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    for layer in cache.layers:
        view = layer.store.encoded.padded(layer.codec, "key", torch.float32)
        assert int(layer.store.encoded.lengths.min()) >= 4
        newest = _scored(model, ids).layers[cache.layers.index(layer)].tail_keys[:, :, -4:]
        for h in range(layer.kv_heads):
            assert torch.equal(view[0, h, -4:], newest[0, h])  # each head ends with the document's last 4 tokens
        assert bool((layer.store.encoded.scores == 1.5).sum() == 4 * layer.kv_heads)
    with pytest.raises(ValueError, match="recent must be an integer >= 0"):
        make_cache("kvzip:recent=-1", model.config)


def test_a_non_finite_decode_step_is_refused_within_the_check_interval():
    # Decode steps fold their NaN/inf check into a device flag read every FINITE_CHECK_EVERY steps (no host read
    # per step), as the other layers do; a prompt-sized step is checked at once.
    from hf_kvcompress.caches.finite_check import FINITE_CHECK_EVERY

    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache("kvzip:ratio=0.5", model.config)
    prefill(model, _ids(20), None, cache, repeat_prompt_ids=REPEAT)
    layer = cache.layers[0]
    assert isinstance(layer.store, HeadStore)
    shape = (1, layer.kv_heads, 1, layer.head_dim)
    bad = torch.randn(shape)
    bad[0, 0, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        prompt = (1, layer.kv_heads, 3, layer.head_dim)
        layer.update(torch.randn(prompt), torch.randn(prompt).fill_(float("inf")), {})
    layer = cache.layers[1]
    with pytest.raises(ValueError, match="NaN or inf"):
        for step in range(FINITE_CHECK_EVERY):
            layer.update(bad if step == 0 else torch.randn(shape), torch.randn(shape), {})
            layer.own_mask.used = True  # what our attention function marks after reading the mask
    assert step == FINITE_CHECK_EVERY - 1


@pytest.mark.parametrize(("name", "dtype", "tolerance"), [
    ("llama", torch.float32, 1e-5), ("llama", torch.bfloat16, 3e-2), ("llama", torch.float16, 3e-3),
    ("gemma3", torch.float32, 1e-5),  # sliding layers, its own query scaling
])
def test_decode_over_each_heads_own_pairs_equals_the_padded_view_and_mask(name, dtype, tolerance, monkeypatch):
    """A decode step of a lossless head store attends over each head's own pairs (`HeadStore.attend`, one SDPA per
    row and KV head, no padded view, no mask): the same logits as the padded view + per-head mask it replaces, in a
    padded batch of rows that evict at different steps, through blocks of tokens joining the pairs."""
    model = use_kvcompress_attention(tiny_model(name)).to(dtype)
    ids, mask = left_padded([_ids(300, seed=15)[0], _ids(200, seed=16)[0]])
    tokens = _ids(79, seed=17, batch=2)
    attended = []
    original = HeadStore.attend
    monkeypatch.setattr(HeadStore, "attend", lambda self, *a: attended.append(1) or original(self, *a))
    cache = make_cache("kvzip:ratio=0.5", model.config)
    fast = kvzip_forced_logits(model, ids, mask, cache, tokens)
    layers = sum(isinstance(layer.store, HeadStore) for layer in cache.layers)
    assert layers and len(attended) == layers * 79  # every decode step but the first (which confirms our attention)
    monkeypatch.setattr(HeadStore, "attends_by_head", property(lambda self: False))
    reference = kvzip_forced_logits(model, ids, mask, make_cache("kvzip:ratio=0.5", model.config), tokens)
    assert len(attended) == layers * 79
    torch.testing.assert_close(fast, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5", "kvzip:ratio=0.5,decoding=evict"])
def test_a_steady_head_store_decode_step_copies_no_pair(spec):
    """A decode step over a lossless head store writes its token into each head's room and attends over views
    (caches/joined_heads.py): between the steps where tokens join the pairs or a row evicts, the joined buffers stay
    the same tensors, and the bytes are what the store promises (its room counted)."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids, mask = left_padded([_ids(300, seed=15)[0], _ids(200, seed=16)[0]])
    cache = make_cache(spec, model.config)
    tokens = _ids(70, seed=18, batch=2)
    position, attention = mask.sum(-1, keepdim=True) - 1, mask
    steady = 0
    with torch.inference_mode():
        prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=REPEAT)
        feed = torch.cat([ids[:, -1:], tokens], 1)
        for i in range(feed.shape[1]):
            before = [(layer.store.joined, layer.store._encoded.pairs) for layer in cache.layers]
            buffers = [None if joined is None else [b.data_ptr() for b in joined.buffers] for joined, _ in before]
            model(input_ids=feed[:, i : i + 1], attention_mask=attention, position_ids=position + i,
                  **cache_kwargs(cache))
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            for layer, (joined, pairs), pointers in zip(cache.layers, before, buffers, strict=True):
                if joined is not None and layer.store.joined is joined and layer.store._encoded.pairs == pairs:
                    steady += 1
                    assert [b.data_ptr() for b in joined.buffers] == pointers  # written in place
            assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    # Every layer joins at its first fused step and gives the pairs back once a block joins them (every 32 steps)
    # or a row evicts: most of its steps are steady (130 and 118 of 140 layer steps when written).
    assert steady >= len(cache.layers) * 55


def test_a_steady_head_store_decode_step_reads_nothing_on_the_host():
    """Between the steps where tokens join the pairs or a row evicts (a block at a time), a decode step over a head
    store reads no tensor value on the host beyond the model's own: the per-head lengths it slices by were read
    when the pairs changed."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids, mask = left_padded([_ids(300, seed=15)[0], _ids(200, seed=16)[0]])
    cache = make_cache("kvzip:ratio=0.5", model.config)
    tokens = _ids(70, seed=18, batch=2)
    position, attention = mask.sum(-1, keepdim=True) - 1, mask
    steady = 0
    with torch.inference_mode():
        # transformers' mask builder may read the padding mask itself (whether SDPA can skip it): what a
        # DynamicCache's step reads is the model's, not the cache's.
        dynamic = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], cache=dynamic)
        with HostSyncCounter() as counter:
            model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=position, cache=dynamic)
        model_reads = counter.count
        prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=REPEAT)
        feed = torch.cat([ids[:, -1:], tokens], 1)
        for i in range(feed.shape[1]):
            before = [(layer.store.encoded.pairs, layer.store.tail_tokens, layer.store.headroom)
                      for layer in cache.layers]
            with HostSyncCounter() as counter:
                model(input_ids=feed[:, i : i + 1], attention_mask=attention, position_ids=position + i,
                      **cache_kwargs(cache))
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            after = [(layer.store.encoded.pairs, layer.store.tail_tokens, layer.store.headroom)
                     for layer in cache.layers]
            # Steady: no pair joined or left, and no row's allowance was checked (`evict` checks once the rows may
            # have added the room the last check left, `headroom`).
            if i > 0 and all(a == (p, t + 1, None if r is None else r - layer.kv_heads)
                             for a, (p, t, r), layer in zip(after, before, cache.layers, strict=True)):
                steady += 1
                assert counter.count == model_reads, f"{counter.count} host reads at decode step {i}"
    assert steady >= 40  # most steps (46 of 70 when written)


@pytest.mark.parametrize("family, span", [("llama", 0), ("gemma3", 4)])
@pytest.mark.parametrize("method", ["kvzip", "kvzap"])
def test_span_is_chosen_by_the_layout_and_the_spec_names_it(family, span, method):
    """span=None (the default) settles to 0 on a model without sliding-window layers (tiny Llama) and to 4 on a
    hybrid one (tiny Gemma-3); every layer runs it and the cache's spec says so; an explicit span wins."""
    from hf_kvcompress.policies.base import WINDOWED_SPAN

    assert WINDOWED_SPAN == 4
    config = tiny_model(family).config
    if method == "kvzap":  # a cache needs a probe fitted for the model (tests/caches/test_kvzap.py): the plan's step
        from hf_kvcompress.caches.plan import for_model
        from hf_kvcompress.policies.kvzap import KVzapPolicy

        assert KVzapPolicy(ratio=0.5).span is None
        assert for_model(KVzapPolicy(ratio=0.5), config).span == span
        assert for_model(KVzapPolicy(ratio=0.5, span=2), config).span == 2
        return
    # A half: below it a plain KVzip ratio on a hybrid model is its byte target (tests/caches/test_ratio_bytes.py)
    cache = make_cache(f"{method}:ratio=0.5", config)
    assert cache.policy.span == span
    assert {layer.policy.span for layer in cache.layers if not layer.is_sliding} == {span}
    assert cache.spec == f"{method}:ratio=0.5,span={span}"
    assert make_cache(f"{method}:ratio=0.5,span=2", config).policy.span == 2
    # Without a config the layers are full attention: as a model without sliding layers.
    assert make_cache(f"{method}:ratio=0.5").policy.span == 0


def test_span_is_checked_and_an_unsettled_span_is_not_scored():
    with pytest.raises(ValueError, match="span must be an integer >= 0, got -1"):
        make_cache("kvzip:ratio=0.5,span=-1", tiny_model("llama").config)
    with pytest.raises(ValueError, match="span must be an integer >= 0"):
        make_cache("kvzap:ratio=0.5,span=-2", tiny_model("llama").config)
    from hf_kvcompress.policies.kvzip import KVzipPolicy

    with pytest.raises(ValueError, match="span=None is chosen by the model's layout"):
        KVzipPolicy(ratio=0.5).score(torch.zeros(1, 2, 5), 5)


def test_a_saved_cache_without_a_span_loads_with_the_span_it_ran(tmp_path):
    """Files saved before the span was settled by layout name none and ran span 4; new files name theirs."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_kvcompress import load_cache, save_cache

    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _ids(24, seed=9)
    cache = make_cache("kvzip:ratio=0.5", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path)
    assert load_cache(path).policy.span == 0
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    assert metadata["spec"] == "kvzip:ratio=0.5,span=0"
    metadata["spec"] = "kvzip:ratio=0.5"
    older = tmp_path / "older.safetensors"
    save_file(load_file(str(path)), str(older), metadata=metadata)
    assert load_cache(older).policy.span == 4
    assert json.loads(metadata["decoding"]) == "append"
