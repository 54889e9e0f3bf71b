"""Each scoring rule against a plain reference computation on a tiny model (eager attention's weights, raw keys)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_kvcompress import make_cache, prefill, use_kvcompress_attention
from hf_kvcompress.measure import measured_kv_bytes

from .tiny_models import tiny_model

IDS = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(11))


def _eager_attentions(name, ids):
    """Attention weights per layer, [B, H_q, q, kv], from transformers' eager attention."""
    model = tiny_model(name)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(input_ids=ids, output_attentions=True).attentions


def _per_kv_head(weights, kv_heads, reduce):
    batch, q_heads, q, kv = weights.shape
    grouped = weights.view(batch, kv_heads, q_heads // kv_heads, q, kv)
    return grouped.sum(dim=(2, 3)) if reduce == "sum" else grouped.amax(dim=(2, 3))


def _full_layers(cache):
    return [(i, layer) for i, layer in enumerate(cache.layers) if not layer.is_sliding]


@pytest.mark.parametrize("spec,queries", [("h2o:ratio=1.0,recent=0", None),
                                          ("snapkv:ratio=1.0,window=3,kernel=1,recent=0", 3), ("tova:ratio=1.0", 1)])
def test_attention_scores_match_eager_weights(spec, queries):
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache(spec, model.config)
    with torch.no_grad():
        model(input_ids=IDS, cache=cache)
    reference = _eager_attentions("llama", IDS)
    for i, layer in _full_layers(cache):
        weights = reference[i] if queries is None else reference[i][:, :, -queries:]
        expected = _per_kv_head(weights, layer.kv_heads, "sum")
        torch.testing.assert_close(layer.accumulated, expected, rtol=1e-4, atol=1e-5)


def test_tova_forgets_older_steps_and_snapkv_pools_neighbours():
    model = use_kvcompress_attention(tiny_model("llama"))
    tova = make_cache("tova:ratio=1.0", model.config)
    longer = torch.cat([IDS, torch.tensor([[7]])], dim=1)
    with torch.no_grad():
        model(input_ids=IDS, cache=tova)
        model(input_ids=longer[:, -1:], cache=tova)
    reference = _eager_attentions("llama", longer)
    for i, layer in _full_layers(tova):
        torch.testing.assert_close(layer.accumulated, _per_kv_head(reference[i][:, :, -1:], layer.kv_heads, "sum"),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    for pooling in ("max", "avg"):
        snap = make_cache(f"snapkv:ratio=1.0,window=3,kernel=3,recent=0,pooling={pooling}", model.config)
        with torch.no_grad():
            model(input_ids=IDS, cache=snap)
        layer = snap.layers[0]
        raw = layer.accumulated
        padded = F.pad(raw, (1, 1))
        # The max, or the mean with zeros past the ends (SnapKV's reference code, kvpress), of each slot's neighbours.
        neighbours = torch.stack([padded[..., j : j + raw.shape[-1]] for j in range(3)])
        expected = neighbours.amax(0) if pooling == "max" else neighbours.sum(0) / 3
        torch.testing.assert_close(snap.policy.score(raw, raw.shape[-1]), expected)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_kvzip_scores_are_the_max_attention_of_the_repeated_context(name):
    model = use_kvcompress_attention(tiny_model(name))
    prompt, chunk, overlap = [5, 6, 7], 5, 2
    cache = make_cache("kvzip:ratio=1.0,budgets=uniform", model.config)
    prefill(model, IDS, None, cache, repeat_prompt_ids=prompt, reconstruction_chunk=chunk,
            reconstruction_overlap=overlap)  # fmt: skip
    context = IDS.shape[1]
    assert cache.get_seq_length() == context and all(layer.stored_tokens <= context for layer in cache.layers)
    # Reference: the context followed by each reconstruction chunk, in one plain eager pass each.
    expected = None
    for start in range(0, context, chunk):
        before = IDS[0, max(start - overlap, 0) : start]
        piece = torch.cat([torch.tensor(prompt), before, IDS[0, start : start + chunk]])
        attentions = _eager_attentions(name, torch.cat([IDS[0], piece])[None])
        per_layer = [_per_kv_head(a[:, :, context:, :context], a.shape[1] // model.config.num_attention_heads
                                  * model.config.num_key_value_heads, "max") for a in attentions]  # fmt: skip
        if expected is not None:
            per_layer = [torch.maximum(e, p) for e, p in zip(expected, per_layer, strict=True)]
        expected = per_layer
    for i, layer in _full_layers(cache):
        torch.testing.assert_close(layer.accumulated, expected[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", ["mean", "each"])
def test_tova_keeps_what_the_newest_query_attends_to_averaged_over_the_layers_heads(heads):
    model = use_kvcompress_attention(tiny_model("llama"))
    dynamic = DynamicCache(config=model.config)
    cache = make_cache(f"tova:budget=6,heads={heads}", model.config)
    with torch.no_grad():
        model(input_ids=IDS, cache=dynamic)
        model(input_ids=IDS, cache=cache)
    reference = _eager_attentions("llama", IDS)
    for i, layer in _full_layers(cache):
        newest = reference[i][:, :, -1:]  # [1, H_q, 1, 12]
        if heads == "mean":  # one ranking for the whole layer (TOVA Sec. 3.3, kvpress's TOVAPress)
            score = newest.mean(dim=(1, 2))[:, None].expand(-1, layer.kv_heads, -1)
        else:
            score = _per_kv_head(newest, layer.kv_heads, "sum")
        kept = score.topk(6, dim=-1).indices.sort(-1).values
        keys = dynamic.layers[i].keys
        expected = torch.gather(keys, 2, kept[..., None].expand(-1, -1, -1, keys.shape[-1]))
        torch.testing.assert_close(layer.tail_keys, expected)


def test_keydiff_keeps_the_keys_least_like_the_mean_direction():
    model = tiny_model("llama")  # no attention statistics needed: plain SDPA
    dynamic = DynamicCache(config=model.config)
    cache = make_cache("keydiff:budget=6", model.config)
    with torch.no_grad():
        model(input_ids=IDS, cache=dynamic)
        model(input_ids=IDS, cache=cache)
    for i, layer in _full_layers(cache):
        keys = dynamic.layers[i].keys  # [1, H_kv, 12, D]
        unit = F.normalize(keys, dim=-1)
        score = -(unit * F.normalize(unit.mean(dim=2, keepdim=True), dim=-1)).sum(-1)
        kept = score.topk(6, dim=-1).indices.sort(-1).values
        expected = torch.gather(keys, 2, kept[..., None].expand(-1, -1, -1, keys.shape[-1]))
        torch.testing.assert_close(layer.tail_keys, expected)


def test_random_keeps_the_positions_its_hash_ranks_highest_and_the_seed_changes_them():
    model = tiny_model("llama")
    kept = {}
    for seed in (0, 1):
        cache = make_cache(f"random:budget=5,seed={seed}", model.config)
        with torch.no_grad():
            model(input_ids=IDS, cache=cache)
        kept[seed] = cache.layers[0].positions[0].long()
        heads = torch.arange(kept[seed].shape[0])[:, None]
        positions = torch.arange(12)[None, :]
        draw = ((positions * 1_000_003 + heads * 7_919 + seed * 104_729) * 2_654_435_761) % 16_777_213
        assert torch.equal(kept[seed], draw.topk(5, dim=-1).indices.sort(-1).values)
    assert not torch.equal(kept[0], kept[1])


def test_kvzip_layer_budgets_follow_one_ranking_across_layers():
    from hf_kvcompress import measured_kv_bytes

    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(16))
    scored = make_cache("kvzip:ratio=1.0,budgets=uniform", model.config)  # keeps everything: the scores stay readable
    prefill(model, ids, None, scored, repeat_prompt_ids=[5, 6, 7])
    scores = [layer.accumulated for layer in scored.layers]  # [1, H_kv, 40] each
    heads = scores[0].shape[1]
    wanted = 10 * heads * len(scores)  # a quarter of 40 tokens, for every head of every layer
    threshold = torch.cat([s.flatten() for s in scores]).sort(descending=True).values[wanted - 1]
    expected = [round(int((s >= threshold).sum()) / heads) for s in scores]

    cache = make_cache("kvzip:ratio=0.25,budgets=layer", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
    assert [layer.stored_tokens for layer in cache.layers] == expected
    assert expected[0] != expected[1]  # the layers really differ on this prompt
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_kvzip_token_budgets_keep_in_every_layer_the_tokens_with_the_best_score_over_layers_and_heads(name):
    from hf_kvcompress import measured_kv_bytes

    model = use_kvcompress_attention(tiny_model(name))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(16))
    # Keeps every context token, so the scores stay readable; on the hybrid model its sliding layers keep what they
    # keep at ratio 0.25 with the plain share (their queries feed the full layer's reconstruction scores; an explicit
    # sliding= keeps the full layer at the ratio's 10 tokens, plan.py `SlidingShare`).
    sliding = ",sliding=2" if name == "gemma3" else ""
    scored = make_cache(f"kvzip:ratio=1.0,budgets=uniform{sliding}", model.config)
    prefill(model, ids, None, scored, repeat_prompt_ids=[5, 6, 7])
    full = _full_layers(scored)
    best = torch.stack([layer.accumulated.amax(dim=1) for _, layer in full]).amax(dim=0)[0]  # [40]
    kept = best.topk(10).indices.sort().values  # span=0: raw scores, no ties

    def kept_keys(spec):
        cache = make_cache(spec, model.config)
        prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
        return [cache.layers[i]._full("key") for i, _ in full]

    for (_, layer), keys in zip(full, kept_keys(f"kvzip:ratio=0.25,budgets=token,span=0{sliding}"), strict=True):
        torch.testing.assert_close(keys, layer._full("key")[..., kept, :])
    if len(full) * model.config.num_key_value_heads > 1:
        # Each layer and head ranking its own tokens keeps others somewhere: the shared ranking is not that one.
        uniform = kept_keys(f"kvzip:ratio=0.25,budgets=uniform,span=0{sliding}")
        assert any(not torch.equal(keys, layer._full("key")[..., kept, :])
                   for (_, layer), keys in zip(full, uniform, strict=True))


def _pre_rope_queries(attention, hidden):
    """[B, H_q, q, D]: the queries `attention` computes from `hidden` before RoPE (q_norm included), scaled."""
    heads = attention.config.num_attention_heads
    if hasattr(attention, "q_proj"):
        projected = attention.q_proj(hidden)
    else:
        projected = attention.qkv_proj(hidden)[..., : heads * attention.head_dim]
    queries = projected.view(*hidden.shape[:2], heads, attention.head_dim).transpose(1, 2)
    if hasattr(attention, "q_norm"):
        queries = attention.q_norm(queries)
    return queries * attention.scaling


def _attention_inputs(model) -> dict[int, list[torch.Tensor]]:
    """Layer index -> the hidden states each forward hands that layer's attention, appended as the forwards run."""
    hidden: dict[int, list[torch.Tensor]] = {}
    for i, block in enumerate(model.model.layers):
        block.self_attn.register_forward_hook(
            lambda module, args, kwargs, out, i=i: hidden.setdefault(i, []).append(kwargs["hidden_states"]),
            with_kwargs=True,
        )
    return hidden


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3"])
def test_expected_attention_models_the_pre_rope_queries_and_scores_by_them(name):
    from tests.policies.expected_attention_reference import reference_scores

    model = use_kvcompress_attention(tiny_model(name))
    hidden = _attention_inputs(model)
    window, future, sinks = 16, 4, 1  # decoding=evict holds the newest `window` queries between steps
    spec = f"expected_attention:ratio=1.0,window={window},future={future},sink_tokens={sinks},decoding=evict"
    cache = make_cache(spec, model.config)
    longer = torch.cat([IDS, torch.tensor([[7]])], dim=1)  # a prompt step, then a decode step
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=IDS, cache=cache)
        model(input_ids=longer[:, -1:], cache=cache)
        model(input_ids=longer, cache=dynamic)
    rotary = model.model.rotary_emb
    inv_freq = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None))
    tokens = longer.shape[1]
    for i, layer in _full_layers(cache):
        # [1, H_q, 13, D]
        expected = _pre_rope_queries(model.model.layers[i].self_attn, torch.cat(hidden[i][:2], dim=1))
        # The window's newest 13 entries are the 13 tokens' queries; the 3 before were never filled.
        torch.testing.assert_close(layer.recent_queries[:, :, window - tokens :], expected, rtol=1e-5, atol=1e-5)
        assert layer.next_position.tolist() == [tokens]
        counted = torch.zeros(1, window, dtype=torch.bool)
        counted[:, window - tokens + sinks :] = True  # the first token's query is a sink's: left out
        keys, values = dynamic.layers[i].keys, dynamic.layers[i].values
        reference = reference_scores(keys, values, layer.recent_queries.double(), counted, torch.tensor([tokens]),
                                     inv_freq, torch.tensor([0]), future, epsilon=cache.policy.epsilon,
                                     sink_tokens=sinks)
        got = cache.policy.score(None, tokens, keys=keys, pads=torch.zeros(1, dtype=torch.long), values=values,
                                 queries=layer.scorer.window(layer))
        torch.testing.assert_close(got.double(), reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_expected_attention_scores_a_prompt_by_all_its_queries_and_holds_none_after(name):
    """The default (`decoding=append`, no window): the prompt step is scored by the statistics of every query of the
    step past the sinks, as kvpress scores a document, the kept pairs are that ranking's, and nothing of the
    queries stays in the cache (its bytes are the kept pairs' alone); a decode step asks for no queries."""
    from hf_kvcompress.policies.base import select_kept
    from tests.policies.expected_attention_reference import reference_scores

    model = use_kvcompress_attention(tiny_model(name))
    hidden = _attention_inputs(model)
    future, sinks, tokens = 4, 1, IDS.shape[1]
    cache = make_cache(f"expected_attention:ratio=0.5,future={future},sink_tokens={sinks}", model.config)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=IDS, cache=cache)
        model(input_ids=IDS, cache=dynamic)
    rotary = model.model.rotary_emb
    inv_freq = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None))
    counted = torch.zeros(1, tokens, dtype=torch.bool)
    counted[:, sinks:] = True
    pads = torch.zeros(1, dtype=torch.long)
    for i, layer in _full_layers(cache):
        assert layer.recent_queries is None  # the step's queries went with its eviction
        queries = _pre_rope_queries(model.model.layers[i].self_attn, hidden[i][0])
        keys, values = dynamic.layers[i].keys, dynamic.layers[i].values
        scores = reference_scores(keys, values, queries.double(), counted, torch.tensor([tokens]), inv_freq, pads,
                                  future, epsilon=cache.policy.epsilon, sink_tokens=sinks)
        kept = select_kept(cache.policy, scores, pads, layer.kv_heads, tokens,
                           keep=torch.tensor([tokens // 2]))  # [1, H_kv, 6]
        expected = keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1]))
        torch.testing.assert_close(layer.tail_keys, expected, rtol=1e-5, atol=1e-5)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    requests = []
    with torch.no_grad():  # a decode step appends unscored: attention is asked for nothing
        for layer in cache.layers:
            layer.observe = lambda delivered, requests=requests: requests.append(delivered)
        model(input_ids=torch.tensor([[7]]), cache=cache)
    assert requests == []
    assert all(layer.stored_tokens == tokens // 2 + 1 for _, layer in _full_layers(cache))


def test_expected_attention_needs_the_models_config():
    with pytest.raises(ValueError, match="config"):
        make_cache("expected_attention:ratio=0.5")


def test_kvzip_refuses_a_reconstruction_pass_without_attention_statistics():
    """With sdpa the pass saw no attention: before, a one-chunk context was evicted by all-zero scores, silently."""
    model = tiny_model("llama")  # its own sdpa attention, not kvcompress_sdpa
    # Built from a copy of the config, the cache cannot switch the model to its attention (CompressedCache).
    cache = make_cache("kvzip:budget=4,budgets=uniform", copy.deepcopy(model.config))
    with pytest.raises(RuntimeError, match="scores tokens by attention"):
        prefill(model, IDS, None, cache, repeat_prompt_ids=[5, 6, 7])
    # Nothing was evicted by the failed pass, and decoding past the budget still asks for the pass.
    assert cache.get_seq_length() == IDS.shape[1]
    assert all(layer.stored_tokens == IDS.shape[1] for layer in cache.layers)
    with pytest.raises(RuntimeError, match="hf_kvcompress.prefill"):
        model(input_ids=IDS[:, :1], cache=cache)
