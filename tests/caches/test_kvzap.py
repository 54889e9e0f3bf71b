"""KVzap (policies/kvzap.py): probe fit, the probe file, and the cache contract on tiny random models.

The probes here are random (a tiny model has no calibration), written as the calibration writes them: what is
tested is that the policy keeps what its probe scores highest, at prefill and while decoding, exactly as the
contract asks of every policy.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches import joined_heads
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.caches.head_store import ABSORB_BLOCK
from hf_kvcompress.caches.joined_heads import JoinedHeads
from hf_kvcompress.calibration import ridge
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.hf.hidden_states import attention_modules
from hf_kvcompress.policies.kvzap import KVzapPolicy
from hf_kvcompress.probe_calibration import (
    calibration_documents,
    full_attention_layers,
    kvzip_targets,
    r_squared,
    spearman,
)
from hf_kvcompress.probes import PROBE_FORMAT, estimated_score, load_probes, save_probe
from hf_kvcompress.registry import parse_spec

from .tiny_models import attend_per_head, kvzip_forced_logits, left_padded_prompts, masked_reference_logits, tiny_model

REPEAT = [5, 6, 7]


def write_probe(config, path, seed=0, scale=1.0):
    """A random probe for `config`'s model, in the calibration's file format (`scale=0`: every token scores the
    same, so ties, broken towards the oldest slot, would evict the newest tokens first)."""
    g = torch.Generator().manual_seed(seed)
    layers = full_attention_layers(config)
    heads = config.num_key_value_heads
    tensors = {}
    for i in layers:
        tensors[f"layers.{i}.weight"] = scale * torch.randn(config.hidden_size, heads, generator=g)
        tensors[f"layers.{i}.bias"] = scale * torch.randn(heads, generator=g)
    metadata = {"format": PROBE_FORMAT, "model": config._name_or_path, "layers": str(config.num_hidden_layers),
                "kv_heads": str(heads), "hidden_size": str(config.hidden_size),
                "probe_layers": ",".join(map(str, layers))}
    return save_probe(tensors, metadata, path)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def probed(request, tmp_path_factory):
    """(model, probe directory) of a tiny model named after its family."""
    model = use_kvcompress_attention(tiny_model(request.param))
    model.config._name_or_path = f"tiny-{request.param}"
    directory = tmp_path_factory.mktemp(f"probe-{request.param}")
    # At a fitted probe's scale (log-scores within a few units): the cache ranks p / (1 + p), which float32 rounds to
    # 1 past a log-score of about 17, so a probe far outside its range would tie.
    write_probe(model.config, directory, scale=0.1)
    return model, directory


class AfterEachStep:
    """A streamer for `generate`: calls `record()` at every `put` (the prompt's last token, then every decode step)."""

    def __init__(self, record):
        self.record = record

    def put(self, value):
        self.record()

    def end(self):
        pass


def _hidden_states(model, ids):
    """The hidden state entering each attention module in one forward pass, as a reference."""
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, kwargs["hidden_states"])
        return hook

    hooks = [m.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, m in enumerate(attention_modules(model))]
    try:
        with torch.no_grad():
            model(input_ids=ids, cache=DynamicCache(config=model.config))
    finally:
        for h in hooks:
            h.remove()
    return seen


# -- the fit -------------------------------------------------------------------------------------------------------

def test_ridge_equals_the_least_squares_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g, dtype=torch.float64)
    noise = 0.1 * torch.randn(200, 3, generator=g, dtype=torch.float64)
    y = x @ torch.randn(12, 3, generator=g, dtype=torch.float64) + noise
    weight, bias = ridge(x, y, 0.0)
    reference = torch.linalg.lstsq(torch.cat([x, torch.ones(200, 1, dtype=x.dtype)], 1), y).solution
    torch.testing.assert_close(weight, reference[:-1], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bias, reference[-1], rtol=1e-9, atol=1e-9)
    # With an L2 term on the weights: least squares on the centred data stacked over sqrt(alpha) * I.
    alpha = 5.0
    weight, bias = ridge(x, y, alpha)
    xc, yc = x - x.mean(0), y - y.mean(0)
    stacked = torch.cat([xc, alpha ** 0.5 * torch.eye(12, dtype=x.dtype)])
    reference = torch.linalg.lstsq(stacked, torch.cat([yc, torch.zeros(12, 3, dtype=x.dtype)])).solution
    torch.testing.assert_close(weight, reference, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bias, y.mean(0) - x.mean(0) @ reference, rtol=1e-9, atol=1e-9)


def test_fit_on_a_tiny_model_equals_least_squares_on_its_kvzip_scores():
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    hidden, targets = kvzip_targets(model, ids, REPEAT)
    reference_hidden = _hidden_states(model, ids)
    cache = make_cache("kvzip:ratio=1.0,budgets=uniform,span=0", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=REPEAT)
    for i in full_attention_layers(model.config):
        torch.testing.assert_close(hidden[i], reference_hidden[i][0])
        torch.testing.assert_close(targets[i], cache.layers[i].slots.accumulated[0].T.clamp(min=1e-6).log())
        x, y = hidden[i].double(), targets[i].double()
        weight, bias = ridge(x, y, 0.0)
        reference = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1), y).solution
        torch.testing.assert_close(x @ weight + bias, x @ reference[:-1] + reference[-1], rtol=1e-6, atol=1e-6)
    assert r_squared(targets[0], targets[0]) == 1.0
    assert spearman(targets[0], targets[0]) == pytest.approx(1.0)


def test_the_calibration_text_is_hotpotqa_the_novel_or_both_alternating(embedded):
    tokenizer = embedded[1]
    novel = calibration_documents(tokenizer, 200, 3, "novel")
    hotpotqa = calibration_documents(tokenizer, 200, 2, "hotpotqa")
    assert all(torch.equal(a, b) for a, b in zip(calibration_documents(tokenizer, 200, 2), hotpotqa, strict=True))
    both = calibration_documents(tokenizer, 200, 5, "both")  # the odd one the novel's
    assert len(novel) == 3 and len(hotpotqa) == 2 and len(both) == 5
    for got, want in zip(both, [novel[0], hotpotqa[0], novel[1], hotpotqa[1], novel[2]], strict=True):
        assert torch.equal(got, want)
    assert all(d.shape[0] == 1 and 150 < d.shape[1] <= 200 for d in both)  # about `tokens`, never more
    # the reason for HotpotQA: names and numbers, which the novel's passages almost lack
    digits = [sum(c.isdigit() for c in tokenizer.decode(d[0])) for d in (*novel[:2], *hotpotqa)]
    assert sum(digits[2:]) > 2 * sum(digits[:2])
    with pytest.raises(ValueError, match="text must be one of hotpotqa, novel, both"):
        calibration_documents(tokenizer, 200, 4, "essays")


# -- the probe file ------------------------------------------------------------------------------------------------

def test_a_probe_for_another_model_is_refused(probed, tmp_path):
    model, directory = probed
    other = type(model.config).from_dict(model.config.to_dict())
    other._name_or_path = "another-model"
    with pytest.raises(ValueError, match="model="):
        load_probes(directory, other)
    with pytest.raises(ValueError, match="model="):
        make_cache(f"kvzap:ratio=0.5,probe={directory}", other)
    with pytest.raises(FileNotFoundError, match="probe="):
        make_cache(f"kvzap:ratio=0.5,probe={tmp_path}", model.config)
    with pytest.raises(ValueError, match="no packaged KVzap probe"):
        make_cache("kvzap:ratio=0.5", model.config)


@pytest.mark.parametrize("kwargs, name", [({"ratio": 1.5}, "ratio"), ({"budget": 0}, "budget"), ({"span": -1}, "span"),
                                          ({"recent": -2}, "recent"), ({"probe": ""}, "probe"),
                                          ({"budgets": "layer"}, "budgets"),
                                          ({"budget": 8, "ratio": 0.5}, "budget"), ({"decoding": "keep"}, "decoding"),
                                          ({"decoding": "append", "budgets": "uniform"}, "decoding")])
def test_bad_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KVzapPolicy(**kwargs)


def test_without_config_or_hooks_it_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="config"):
        make_cache("kvzap:ratio=0.5")
    model = tiny_model("llama")  # not switched to our attention: no hooks
    model.config._name_or_path = "tiny-unhooked"
    write_probe(model.config, tmp_path)
    cache = make_cache(f"kvzap:ratio=0.5,probe={tmp_path}", model.config)
    with pytest.raises(RuntimeError, match="use_kvcompress_attention"):
        model(input_ids=torch.randint(3, 128, (1, 6)), cache=cache)


# -- scores --------------------------------------------------------------------------------------------------------

def test_scores_are_the_probe_of_the_hidden_state_at_prefill_and_at_decode(probed):
    model, directory = probed
    probes = load_probes(directory, model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    at_once = make_cache(f"kvzap:ratio=1.0,budgets=uniform,probe={directory}", model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=at_once)
    stepwise = make_cache(f"kvzap:ratio=1.0,budgets=uniform,probe={directory}", model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :8], cache=stepwise)
        for t in range(8, 20):  # decode steps, one token each
            model(input_ids=ids[:, t : t + 1], cache=stepwise)
    reference = _hidden_states(model, ids)
    for i, probe in probes.items():
        expected = estimated_score(probe(reference[i]))
        torch.testing.assert_close(at_once.layers[i].slots.accumulated, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stepwise.layers[i].slots.accumulated, expected, rtol=1e-4, atol=1e-4)


def test_each_head_keeps_its_best_scored_tokens(probed):
    model, directory = probed
    probes = load_probes(directory, model.config)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    cache = make_cache(f"kvzap:budget=6,recent=0,span=0,budgets=uniform,probe={directory}", model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    reference = _hidden_states(model, ids)
    for i, probe in probes.items():
        scores = estimated_score(probe(reference[i]))
        best = scores.topk(6, dim=-1).indices.sort(-1).values
        expected = torch.gather(scores, -1, best)
        torch.testing.assert_close(cache.layers[i].slots.accumulated, expected, rtol=1e-4, atol=1e-4)
        assert cache.layers[i].stored_tokens == 6


def test_the_recent_window_is_kept_whatever_the_probe_says(probed):
    """The newest `recent` tokens stay, the rest is the probe's best: at one prefill, then for a question appended
    to the compressed document in a second call (it arrives while the document already fills the ratio)."""
    model, directory = probed
    probes = load_probes(directory, model.config)
    # Distinct tokens: the first layer scores a token by its embedding, and a repeated token's tie is the slots' order.
    ids = 3 + torch.randperm(125, generator=torch.Generator().manual_seed(5))[None, :40]
    cache = make_cache(f"kvzap:ratio=0.5,recent=8,span=0,budgets=uniform,probe={directory}", model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :34], cache=cache)  # the document
        model(input_ids=ids[:, 34:], cache=cache)  # the question, 6 tokens
    reference = _hidden_states(model, ids)
    for i, probe in probes.items():
        # The document's scores are the reference's; the question's come from the cache itself (past the first
        # layer its hidden states follow the layers before, which attend over a compressed document).
        document = estimated_score(probe(reference[i]))[..., :34]
        scores = torch.cat([document, cache.layers[i].slots.accumulated[..., -6:]], -1)
        older = scores[..., :26].topk(17 - 8, dim=-1).indices  # the document's share (17 of 34) less its window (26-33)
        # At the question: 20 kept of 40, 8 of them the window (34-39, and 32-33 of the document's window).
        survivors = torch.cat([older, torch.arange(26, 32).expand(1, scores.shape[1], 6)], -1)
        best = torch.gather(scores, -1, survivors).topk(12, dim=-1).indices
        kept = torch.cat([torch.gather(survivors, -1, best), torch.arange(32, 40).expand(1, scores.shape[1], 8)], -1)
        expected = torch.gather(scores, -1, kept.sort(-1).values)
        torch.testing.assert_close(cache.layers[i].slots.accumulated, expected, rtol=1e-4, atol=1e-4)


def test_by_default_a_question_is_kept_as_it_arrives(tmp_path):
    """A probe that scores every token the same (ties go to the oldest slot) evicts an appended question's tokens
    without the window, and keeps them with the default one (read in the first layer, whose keys depend on the
    tokens alone)."""
    model = use_kvcompress_attention(tiny_model("llama"))
    model.config._name_or_path = "tiny-llama-tied"
    write_probe(model.config, tmp_path, scale=0.0)
    assert KVzapPolicy().recent == 128
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    question = ids[:, 290:]
    for spec, kept in ((f"kvzap:ratio=0.25,budgets=uniform,probe={tmp_path}", True),
                       (f"kvzap:ratio=0.25,recent=0,budgets=uniform,probe={tmp_path}", False)):
        cache = make_cache(spec, model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :290], cache=cache)
            model(input_ids=question, cache=cache)
        index, layer = 0, cache.layers[0]
        reference = make_cache(f"kvzap:ratio=1.0,budgets=uniform,probe={tmp_path}", model.config)
        with torch.no_grad():
            model(input_ids=ids, cache=reference)
        newest = reference.layers[index]._full("key")[..., -10:, :]
        # Close, not equal: the reference projects 300 tokens in one matmul, the cache 290 then 10, and a
        # multithreaded BLAS rounds a row differently with another number of rows. Evicted question tokens would
        # leave other tokens' keys in these slots, far from these.
        assert torch.allclose(layer._full("key")[..., -10:, :], newest, rtol=1e-4, atol=1e-5) is kept, spec


def _kept_scores(layer):
    """Per KV head of row 0, the scores of the pairs a ranked layer's head store keeps (identity codec: all encoded)."""
    store = layer.store
    assert layer.per_head and store.exact is None
    return list(store.encoded.scores.split(store.encoded.lengths[0].tolist()))


@pytest.mark.parametrize("run", ["prefill", "generate"])
def test_head_budgets_keep_the_best_estimates_of_all_layers_and_heads(probed, run):
    """budgets=head (the default): once the prompt is read (at `prefill`'s end, or at model.generate's first decode
    step), one ranking of every full-attention layer's (head, token) pairs by the probe's estimates: every kept pair
    scores at least every evicted one, the heads keep different numbers, and the row keeps the ratio's share."""
    model, directory = probed
    probes = load_probes(directory, model.config)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(7))
    cache = make_cache(f"kvzap:ratio=0.5,recent=0,span=0,probe={directory}", model.config)
    with torch.no_grad():
        if run == "prefill":
            prefill(model, ids, None, cache)
        else:
            model(input_ids=ids, cache=cache)
            assert not any(layer.per_head for layer in cache.layers)  # held whole until the prompt is read
            model(input_ids=ids[:, :1], cache=cache)  # the first decode step ranks, then joins the store's tail
    reference = _hidden_states(model, ids)
    kept, evicted, counts = [], [], []
    for i, probe in probes.items():
        scores = estimated_score(probe(reference[i]))[0]  # [H, T]
        for head, held in enumerate(_kept_scores(cache.layers[i])):
            distance = (scores[head][:, None] - held[None, :]).abs()  # [T, kept]
            assert bool((distance.min(0).values < 1e-5).all())  # each kept score is one of the head's estimates
            inside = distance.min(1).values < 1e-5
            assert int(inside.sum()) == len(held)
            kept.append(scores[head][inside])
            evicted.append(scores[head][~inside])
            counts.append(int(inside.sum()))
    assert torch.cat(kept).min() >= torch.cat(evicted).max()
    assert len(set(counts)) > 1 or len(counts) == 1  # (tiny Gemma: one full-attention layer, one KV head)
    if not any(layer.is_sliding for layer in cache.layers):
        assert sum(counts) == 12 * len(counts)


@pytest.mark.parametrize("recent", [0, 8])
def test_head_budgets_score_later_tokens_as_at_prefill(probed, recent):
    """After the ranking, each token is scored by the probe as it arrives, exactly as a prompt token is: the head
    store keeps, per head, the prompt's scores then the decoded tokens' (those that joined the pairs and those
    still in its tail), all the probe's estimates of the same hidden states (nothing is evicted: 52 < 64). The
    prompt's `recent` newest start the tail with their estimates and join the pairs with them once decoded tokens
    push them out, as decoded tokens do (not at the recent window's score, head_store.py `rank`)."""
    model, directory = probed
    probes = load_probes(directory, model.config)
    ids = torch.randint(3, 128, (1, 52), generator=torch.Generator().manual_seed(11))
    # The reference is one uncompressed pass: on the hybrid model the sliding layers keep their whole window
    # (`sliding=5`), not a budget's planned share (plan.py `plans_budget_share`), which one pass cannot reproduce.
    whole = ",sliding=5" if any(layer.is_sliding for layer in make_cache("dynamic", model.config).layers) else ""
    cache = make_cache(f"kvzap:budget=64,recent={recent},span=0{whole},probe={directory}", model.config)
    assert cache.planned_sliding is None
    with torch.no_grad():
        model(input_ids=ids[:, :12], cache=cache)
        for t in range(12, 52):  # the first ranks the prompt, every one is scored as it arrives
            model(input_ids=ids[:, t : t + 1], cache=cache)
    reference = _hidden_states(model, ids)
    for i, probe in probes.items():
        store = cache.layers[i].store
        assert cache.layers[i].per_head and store.tail_scores is not None
        assert store.tail_tokens < 32 < 52 - 12  # some decoded tokens joined the pairs, some are in the tail
        expected = estimated_score(probe(reference[i]))[0]  # [H, 52]
        for head, held in enumerate(_kept_scores(cache.layers[i])):
            got = torch.cat([held, store.tail_scores[0, head]])
            torch.testing.assert_close(got, expected[head], rtol=1e-4, atol=1e-5)


def test_head_budgets_hold_the_budget_while_decoding(probed):
    """budget=N through a long generation: from the ranking on, the ranked layers hold at most their allowances (their
    pairs at the ranking) in all (head_store.py `RankedTogether`), decoded tokens compete with the prompt's pairs by
    their probe scores (some are evicted while prompt pairs stay), and the bytes never exceed those at the ranking by
    more than a tail: the newest `recent` + ABSORB_BLOCK tokens per ranked layer, which a layer whose allowance is
    smaller keeps stored (masked) until they join its pairs."""
    model, directory = probed
    cache = make_cache(f"kvzap:budget=64,recent=4,probe={directory}", model.config)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        prefill(model, ids, None, cache)  # ranks at its end
    ranked = [layer for layer in cache.layers if layer.per_head]
    assert ranked
    allowance = [int(layer.store.allowance[0]) for layer in ranked]
    at_ranking = measured_kv_bytes(cache)
    held = []

    def record():  # after every step
        held.append((measured_kv_bytes(cache), cache.promised_kv_bytes(),
                     [int(layer.store.held_pairs()[0]) for layer in ranked]))

    out = generate(model, torch.cat([ids, ids[:, -1:]], 1), None, cache, max_new_tokens=120, min_new_tokens=120,
                   streamer=AfterEachStep(record))
    assert out.new_tokens.shape[1] == 120
    assert all(m == p for m, p, _ in held)
    assert all(sum(counts) <= sum(allowance) for _, _, counts in held)
    heads, dim = ranked[0].kv_heads, ranked[0].head_dim
    tail = (4 + ABSORB_BLOCK) * (heads * (2 * dim * 4 + 4) + 1)  # float32 keys, values and score; valid flag
    assert max(m for m, _, _ in held) <= at_ranking + tail * len(ranked)
    # Decoded tokens joined the pairs with their probe scores (below 1; tokens ranked above the prompt score 2 and
    # more).
    later = [layer.store.encoded.scores for layer in ranked]
    assert all(bool((s < 1).any()) and bool((s < 2).all()) for s in later)


def test_layers_ranked_together_hold_one_allowance_while_decoding(probed):
    """The ranked layers of one ranking hold one allowance while decoding (head_store.py `RankedTogether`): a pair
    goes when it is the lowest of every ranked layer's and head's, as the ranking chose among all of them. So the
    prompt's pairs still held after a long generation are its best across layers (each scores at least every prompt
    pair evicted, whichever layer held it), and the row holds at most the allowances' sum. Per-layer allowances
    (before) keep each layer's best instead, and a layer the ranking gave few pairs loses them all to its newest
    tokens."""
    model, directory = probed
    cache = make_cache(f"kvzap:budget=32,recent=4,span=0,probe={directory}", model.config)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        prefill(model, ids, None, cache)  # ranks at its end
    ranked = [layer for layer in cache.layers if layer.per_head]
    together = ranked[0].store.together
    assert (together is None) == (len(ranked) == 1)  # tiny Gemma: one full-attention layer
    ranked_scores = torch.cat([layer.store.encoded.scores for layer in ranked])
    prompt = ranked_scores[ranked_scores < 1]  # the prompt's pairs the probe ranked (its `recent` newest score 1.5)
    allowance = sum(int(layer.store.allowance[0]) for layer in ranked)
    held = []

    def record():  # after every step
        held.append(sum(int(layer.store.held_pairs()[0]) for layer in ranked))

    generate(model, torch.cat([ids, ids[:, -1:]], 1), None, cache, max_new_tokens=12, min_new_tokens=12,
             streamer=AfterEachStep(record))
    assert max(held) <= allowance
    # The prompt's ranked pairs still held: scores of the prompt's (decoded tokens' estimates differ from them).
    kept = torch.cat([layer.store.encoded.scores for layer in ranked])
    kept_prompt = kept[torch.isin(kept, prompt)]
    evicted = prompt[~torch.isin(prompt, kept_prompt)]
    assert evicted.numel() > 0 and kept_prompt.numel() > 0  # the generation evicted some of the prompt, not all
    assert float(kept_prompt.min()) >= float(evicted.max())


def test_a_budget_below_the_default_window_names_recent():
    with pytest.raises(ValueError, match="recent"):
        KVzapPolicy(budget=64)
    assert KVzapPolicy(budget=64, recent=16).recent == 16


# -- the contract --------------------------------------------------------------------------------------------------

SPECS = ["kvzap:ratio=0.5", "kvzap:ratio=0.5,recent=4", "kvzap:budget=8,recent=0",
         "kvzap:ratio=0.5,recent=2,decoding=append", "kvzap:ratio=0.5,recent=2,decoding=evict",
         "kvzap:budget=8,recent=2,decoding=append+int4:residual_length=2,group_size=16",
         "kvzap:budget=8,recent=2,sink_tokens=1+int8",
         "kvzap:ratio=0.5,recent=2,span=0+int4:residual_length=2,group_size=16", "kvzap:budget=8,recent=3+fp8",
         "kvzap:ratio=0.5,budgets=uniform", "kvzap:budget=8,recent=0,budgets=uniform",
         "kvzap:budget=8,recent=2,sink_tokens=1,budgets=uniform+int8"]


def _spec(spec, directory):
    head, _, codec = spec.partition("+")
    return f"{head},probe={directory}" + (f"+{codec}" if codec else "")


@pytest.mark.parametrize("spec", SPECS)
def test_padded_batch_matches_rows_alone(probed, spec):
    model, directory = probed
    rows, ids, mask = left_padded_prompts()
    spec = _spec(spec, directory)
    batched = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=8).new_tokens
    for i, row in enumerate(rows):
        alone = generate(model, row[None], torch.ones(1, len(row), dtype=torch.long), make_cache(spec, model.config),
                         max_new_tokens=8).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i} differs with {spec}"


@pytest.mark.parametrize("spec", ["kvzap:ratio=1.0", "kvzap:budget=1000", "kvzap:ratio=1.0,budgets=uniform",
                                  "kvzap:ratio=1.0,decoding=append", "kvzap:ratio=1.0,decoding=evict",
                                  "kvzap:budget=1000,budgets=uniform"])
def test_large_budget_equals_dynamic_cache(probed, spec):
    """Everything kept equals transformers' own cache; on a hybrid model a budget with head budgets plans its
    sliding layers (plan.py `plans_budget_share`), so there it equals the same cache with their planned window."""
    model, directory = probed
    _, ids, mask = left_padded_prompts(1)
    cache = make_cache(_spec(spec, directory), model.config)
    reference = DynamicCache(config=model.config)
    if cache.planned_sliding is not None and cache.policy.budget is not None:
        reference = make_cache(f"dynamic:sliding={cache.planned_sliding}", model.config)
    expected = generate(model, ids, mask, reference, max_new_tokens=10).new_tokens
    got = generate(model, ids, mask, cache, max_new_tokens=10).new_tokens
    assert torch.equal(got, expected)


@pytest.mark.parametrize("spec", ["kvzap:budget=8,recent=0,budgets=uniform",
                                  "kvzap:budget=8,recent=2,budgets=uniform+int4:residual_length=2,group_size=16"])
def test_budget_bounds_memory_through_a_long_generation(probed, spec):
    """Through plain model.generate: bytes stop growing once the budget is reached and equal the promise."""
    model, directory = probed
    cache = make_cache(_spec(spec, directory), model.config)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    held = []

    def record():  # after every step
        full = SimpleNamespace(layers=[layer for layer in cache.layers if not layer.is_sliding])
        held.append((measured_kv_bytes(cache), cache.promised_kv_bytes(), measured_kv_bytes(full)))

    model.generate(input_ids=ids, cache=cache, max_new_tokens=40, do_sample=False, streamer=AfterEachStep(record))
    assert all(m == p for m, p, _ in held)
    # The full-attention layers' bytes (a sliding layer's block window keeps between its window and a block more).
    measured = [f for _, _, f in held]
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert all(layer.stored_tokens == 8 and layer.seen == 44 for layer in full)
    reached = next(n for n, m in enumerate(measured) if m == max(measured))
    assert reached < 10 and len(set(measured[reached:])) == 1


def test_head_budgets_bound_memory_through_a_long_generation(probed):
    """Through plain model.generate with the default head budgets: the first decode step ranks the prompt, and from
    then on each ranked layer holds at most the budget's pairs per row (its store evicts a block at a time, so it may
    hold a few less), the bytes stop growing and equal the promise."""
    model, directory = probed
    cache = make_cache(f"kvzap:budget=8,recent=0,probe={directory}", model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(8))
    held = []

    def record():  # after every step
        ranked = [layer for layer in cache.layers if layer.per_head]
        held.append((measured_kv_bytes(cache), cache.promised_kv_bytes(),
                     [int(layer.store.held_pairs()[0]) for layer in ranked], len(ranked)))

    model.generate(input_ids=ids, cache=cache, max_new_tokens=40, do_sample=False, streamer=AfterEachStep(record))
    assert all(m == p for m, p, _, _ in held)
    full = [layer for layer in cache.layers if not layer.is_sliding]
    # Puts: the prompt, the token the prompt's forward pass chose, then one per decode step, each after the ranking.
    after = [h for h in held if h[3] == len(full)]
    assert len(after) == 39
    heads = full[0].kv_heads
    # Layers and heads hold different numbers of pairs; the row holds no more than the budget's in all (on the
    # hybrid model the budget plus what its sliding layers left, plan.py `budget_full_tokens`).
    budget = full[0].policy.budget
    assert budget == (8 if len(full) == len(cache.layers) else 8 + (5 - cache.planned_sliding) * 2)
    assert all(sum(counts) <= budget * heads * len(full) for _, _, counts, _ in after)
    # A budget of 8 is smaller than the store's tail (up to ABSORB_BLOCK tokens): the tail's evicted slots stay stored,
    # masked, until they join the pairs, then the bytes fall back (a sawtooth); with a budget above the tail they
    # stay within one tail of the ranking's (test_head_budgets_hold_the_budget_while_decoding), and
    # `budgets=uniform` holds them constant (test above).
    grown = max(range(len(after)), key=lambda n: after[n][0])
    assert any(m <= after[0][0] * 1.1 for m, _, _, _ in after[grown + 1 :])


# -- the layout's span and decoding="append" -------------------------------------------------------------------------

def test_span_is_chosen_by_the_layout_and_the_spec_names_it(probed):
    """span=None (the default) settles to 0 without sliding-window layers (tiny Llama), 4 with them (tiny Gemma-3)."""
    model, directory = probed
    span = 4 if "sliding_attention" in (getattr(model.config, "layer_types", None) or []) else 0
    cache = make_cache(f"kvzap:ratio=0.5,probe={directory}", model.config)
    assert cache.policy.span == span and {layer.policy.span for layer in cache.layers if not layer.is_sliding} == {span}
    assert f"span={span}" in cache.spec
    assert make_cache(f"kvzap:ratio=0.5,span=2,probe={directory}", model.config).policy.span == 2


def _top_pairs(scores, count):
    """Plain global ranking: of per-layer scores [H, T], the `count` best (layer, head, token) pairs, as masks."""
    flat = torch.cat([s.flatten() for s in scores])
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept[flat.topk(count).indices] = True
    return [m.view_as(s) for m, s in zip(kept.split([s.numel() for s in scores]), scores, strict=True)]


def test_append_decodes_as_the_full_cache_with_the_rankings_evicted_pairs_masked(tmp_path):
    """decoding="append": once the prompt is ranked (the probe's estimates, one ranking of every pair), a question
    and the answer's steps attend over exactly the ranked pairs plus every later token: the logits equal a full
    cache's with the other prompt pairs masked, every later token is held, and the bytes are the promise."""
    model = use_kvcompress_attention(tiny_model("llama"))
    model.config._name_or_path = "tiny-llama-append"
    write_probe(model.config, tmp_path, scale=0.1)
    probes = load_probes(tmp_path, model.config)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    steps = [torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(4))]
    steps += [torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(20 + i)) for i in range(40)]
    reference_states = _hidden_states(model, ids)
    scores = [estimated_score(probes[i](reference_states[i]))[0] for i in sorted(probes)]  # [H, 30] per layer
    heads = model.config.num_key_value_heads
    expected_keep = _top_pairs(scores, 12 * heads * len(scores))  # ratio 0.4 of 30 tokens: 12 pairs per head
    cache = make_cache(f"kvzap:ratio=0.4,recent=0,span=0,decoding=append,probe={tmp_path}", model.config)
    full = DynamicCache(config=model.config)
    with torch.inference_mode():
        prefill(model, ids, None, cache)
        model(input_ids=ids, cache=full)
    ranked = [int(layer.store.held_pairs()[0]) for layer in cache.layers]
    assert ranked == [int(keep.sum()) for keep in expected_keep]
    outs, position = [], 30
    with torch.inference_mode():
        for step in steps:
            where = torch.arange(position, position + step.shape[1])[None]
            outs.append(model(input_ids=step, cache=cache, position_ids=where).logits)
            position += step.shape[1]
            assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    refs = masked_reference_logits(model, full, steps, dict(enumerate(expected_keep)), start=30)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    later = sum(step.shape[1] for step in steps)  # 44: past the tail, so later tokens joined the pairs
    for layer, pairs in zip(cache.layers, ranked, strict=True):
        assert int(layer.store.held_pairs()[0]) == pairs + later * layer.kv_heads


def test_evict_gives_later_tokens_the_prompts_lowest_pairs(probed):
    """decoding="evict": the share holds over every token seen, so 40 later tokens keep about a share's worth of
    pairs per head; "append" (the default for a ratio) holds every one of them beside the ranked pairs."""
    model, directory = probed
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    more = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    assert KVzapPolicy(ratio=0.25).resolved_decoding == "append"
    assert KVzapPolicy(budget=256).resolved_decoding == "evict"  # a budget bounds memory while decoding
    assert KVzapPolicy(ratio=0.25, budgets="uniform").resolved_decoding == "evict"
    held = {}
    for decoding in ("append", "evict"):
        cache = make_cache(f"kvzap:ratio=0.25,recent=0,decoding={decoding},probe={directory}", model.config)
        with torch.inference_mode():
            prefill(model, ids, None, cache)
            ranked = [int(layer.store.held_pairs()[0]) for layer in cache.layers if layer.per_head]
            model(input_ids=more, cache=cache)
        now = [int(layer.store.held_pairs()[0]) for layer in cache.layers if layer.per_head]
        held[decoding] = [n - r for n, r in zip(now, ranked, strict=True)]
        assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    heads = next(layer for layer in cache.layers if layer.per_head).kv_heads
    assert held["append"] == [40 * heads] * len(held["append"])
    assert all(h < 40 * heads * 0.25 + heads for h in held["evict"])


@pytest.mark.parametrize("decoding", ["append", "evict"])
def test_save_and_load_keep_the_decoding(probed, tmp_path, decoding):
    """A saved cache loads with the decoding it ran and answers as the cache it was saved from; a file saved
    before KVzap took `decoding` (null) loads as it ran then: evicting."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_kvcompress import load_cache, save_cache

    model, directory = probed
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = make_cache(f"kvzap:ratio=0.5,recent=4,decoding={decoding},probe={directory}", model.config)
    prefill(model, ids, None, cache)
    path = tmp_path / "kvzap.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    assert loaded.policy.resolved_decoding == decoding
    full = torch.cat([ids, torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(7))], 1)
    ones = torch.ones_like(full)
    expected = generate(model, full, ones, copy.deepcopy(cache), max_new_tokens=6).new_tokens
    assert torch.equal(generate(model, full, ones, loaded, max_new_tokens=6).new_tokens, expected)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    assert json.loads(metadata["decoding"]) == decoding
    metadata["decoding"] = "null"
    older = tmp_path / "older.safetensors"
    save_file(load_file(str(path)), str(older), metadata=metadata)
    assert load_cache(older).policy.resolved_decoding == "evict"


def test_save_and_load_keep_the_layers_ranked_together(probed, tmp_path):
    """A `budget=` cache saved after its ranking loads with its ranked layers holding one allowance together, and
    answers as the cache it was saved from through a generation that evicts; a file saved before (no
    `ranked_together`) loads with each layer holding its own, as it ran then."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_kvcompress import load_cache, save_cache

    model, directory = probed
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(21))
    cache = make_cache(f"kvzap:budget=32,recent=4,probe={directory}", model.config)
    prefill(model, ids, None, cache)
    several = sum(layer.per_head for layer in cache.layers) > 1  # tiny Gemma: one ranked layer
    path = tmp_path / "kvzap.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    stores = [layer.store for layer in loaded.layers if layer.per_head]
    assert all((store.together is not None) == several for store in stores)
    full = torch.cat([ids, ids[:, -1:]], 1)
    ones = torch.ones_like(full)
    expected = generate(model, full, ones, copy.deepcopy(cache), max_new_tokens=40, min_new_tokens=40).new_tokens
    assert torch.equal(generate(model, full, ones, loaded, max_new_tokens=40, min_new_tokens=40).new_tokens, expected)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    assert json.loads(metadata["ranked_together"]) == several
    del metadata["ranked_together"]
    older = tmp_path / "older.safetensors"
    save_file(load_file(str(path)), str(older), metadata=metadata)
    assert all(layer.store.together is None for layer in load_cache(older).layers if layer.per_head)


def test_budget_holds_the_bytes_on_a_hybrid_model_with_several_full_attention_layers(tmp_path):
    """`kvzap:budget=N` on a tiny hybrid model with two full-attention layers (Gemma-3's layout: sliding layers
    between them): the two ranked layers hold one allowance while decoding, the bytes equal the promise at every
    step, and from the ranking on they never exceed the ranking's by more than a tail per ranked layer (the newest
    `recent` + ABSORB_BLOCK tokens, stored until they join the pairs), however long the generation."""
    model = _hybrid_two_full(tmp_path, window=6)
    cache = make_cache(f"kvzap:budget=24,recent=4,probe={tmp_path}", model.config)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        prefill(model, ids, None, cache)
    ranked = [layer for layer in cache.layers if layer.per_head]
    assert len(ranked) == 2 and ranked[0].store.together is ranked[1].store.together is not None
    allowance = sum(int(layer.store.allowance[0]) for layer in ranked)
    at_ranking = measured_kv_bytes(cache)
    held = _bytes_while_decoding(model, ids, cache, ranked, 120)
    assert all(m == p for m, p, _ in held)
    assert all(pairs <= allowance for _, _, pairs in held)
    tail = (4 + ABSORB_BLOCK) * (2 * 32 * 4 + 4 + 1)  # float32 key, value and score per token; valid flag
    assert max(m for m, _, _ in held) <= at_ranking + tail * len(ranked)


def _bytes_while_decoding(model, ids, cache, ranked, steps: int) -> list[tuple[int, int, int]]:
    """Decode `steps` greedy tokens after the prefilled `ids` (its last token fed first); after every step (measured
    bytes, promised bytes, pairs row 0 holds in the `ranked` layers)."""
    trace = []

    def record():
        trace.append((measured_kv_bytes(cache), cache.promised_kv_bytes(),
                      sum(int(layer.store.held_pairs()[0]) for layer in ranked)))

    generate(model, torch.cat([ids, ids[:, -1:]], 1), None, cache, max_new_tokens=steps, min_new_tokens=steps,
             streamer=AfterEachStep(record))
    return trace


def _hybrid_two_full(tmp_path, window: int):
    """A tiny Gemma-3 with two sliding and two full-attention layers (one KV head each) and a random probe."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    model = use_kvcompress_attention(model)
    model.config._name_or_path = "tiny-gemma3-two-full"
    write_probe(model.config, tmp_path, scale=0.1)
    return model


@pytest.mark.parametrize("extra, sliding, full", [("", 4, 20), (",sliding=2", 2, 22)])
def test_a_budget_gives_the_full_layers_what_the_sliding_layers_leave(tmp_path, extra, sliding, full):
    """`kvzap:budget=N` on a hybrid model (plan.py `plans_budget_share`): each sliding layer keeps its planned newest
    tokens (a half's plan of its 15, 4; or `sliding=`) and the full-attention layers the budget's allowance the
    sliding layers leave (12 - 4 each, shared by the 2 full layers), so the cache holds as many pairs as the same
    budget in every layer would (2 x 12 + 2 x 12), more of them in the ranked layers; the bytes equal the promise
    and the ranked layers never hold more than that while decoding; a saved cache loads with the same plan. Before
    it, the sliding layers kept 12 and the full-attention layers 12 each."""
    from hf_kvcompress import load_cache, save_cache

    model = _hybrid_two_full(tmp_path, window=16)
    cache = make_cache(f"kvzap:budget=12,recent=4{extra},probe={tmp_path}", model.config)
    assert cache.planned_sliding == sliding
    assert {layer.policy.budget for layer in cache.layers if not layer.is_sliding} == {full}
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        prefill(model, ids, None, cache)
    ranked = [layer for layer in cache.layers if layer.per_head]
    assert len(ranked) == 2
    assert [layer.stored_tokens for layer in cache.layers if layer.is_sliding] == [sliding, sliding]
    held = sum(int(layer.store.held_pairs()[0]) for layer in ranked)
    assert held == 2 * full and held + 2 * sliding == 2 * 12 + 2 * 12
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    assert loaded.planned_sliding == sliding
    assert {layer.policy.budget for layer in loaded.layers if not layer.is_sliding} == {full}
    trace = _bytes_while_decoding(model, ids, cache, ranked, 40)
    assert all(m == p for m, p, _ in trace)
    assert all(pairs <= 2 * full for _, _, pairs in trace)
    assert [layer.stored_tokens for layer in cache.layers if layer.is_sliding] == [sliding, sliding]


def test_a_budget_plans_only_kvzaps_head_budgets_on_hybrid_models(tmp_path):
    """The budget's share is planned for head budgets (one ranking, one allowance while decoding) only:
    `budgets=uniform` keeps the budget in every layer (each sliding layer its min(budget, window - 1))."""
    model = _hybrid_two_full(tmp_path, window=16)
    cache = make_cache(f"kvzap:budget=12,recent=4,budgets=uniform,probe={tmp_path}", model.config)
    assert cache.planned_sliding is None
    assert {layer.policy.budget for layer in cache.layers if not layer.is_sliding} == {12}


@pytest.mark.parametrize("slack", [None, 0])  # None: GROUP_SLACK; 0: each layer's heads all in one masked call
@pytest.mark.parametrize("lengths", [(60,), (60, 90, 75)])
@pytest.mark.parametrize("spec", ["kvzap:ratio=0.25,recent=8", "kvzap:budget=40,recent=8", "kvzip:ratio=0.25"])
def test_heads_attended_in_groups_decode_as_one_call_per_head(probed, spec, lengths, slack, monkeypatch):
    """A head store's decode step attends over heads of close lengths in one SDPA call each group (gaps masked,
    caches/joined_heads.py): the same logits as one call per (row, KV head), within float32 rounding, and the same
    greedy tokens, alone and in a left-padded batch, through blocks joining the pairs and (budget) evictions."""
    model, directory = probed
    _, ids, mask = left_padded_prompts(seed=5, lengths=lengths)
    tokens = torch.randint(3, 128, (len(lengths), 45), generator=torch.Generator().manual_seed(6))
    if spec.startswith("kvzap"):
        spec = _spec(spec, directory)
    elif "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        # a plain quarter is a byte target in int4, whose store attends otherwise; the ratio's own plan (an explicit
        # sliding= on tiny gemma3, ratio_bytes=False below on the others) keeps exact pairs
        spec += ",sliding=2"

    def build():
        return CompressedCache(*parse_spec(spec), config=model.config, ratio_bytes=not spec.startswith("kvzip"))
    monkeypatch.setattr(joined_heads, "GROUP_SLACK", 0 if slack == 0 else joined_heads.GROUP_SLACK)
    grouped_calls, heads = [], []
    attend = JoinedHeads.attend

    def counted(joined, query, scaling):
        grouped_calls.append(len(joined.groups))
        heads.append(len(joined.counts))
        return attend(joined, query, scaling)

    monkeypatch.setattr(JoinedHeads, "attend", counted)
    cache = build()
    grouped = kvzip_forced_logits(model, ids, mask, cache, tokens)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    monkeypatch.setattr(JoinedHeads, "attend", attend_per_head)
    reference = kvzip_forced_logits(model, ids, mask, build(), tokens)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped.argmax(-1), reference.argmax(-1))
    assert len(grouped_calls) == len(heads) > 0
    if slack == 0:  # a layer's heads in one call, those shorter than its widest after a masked gap
        assert set(grouped_calls) == {1}
