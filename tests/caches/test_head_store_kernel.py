"""Decode steps over a lossy per-head store read its encoded pairs where they lie through the C++ kernel
(`HeadStore.attend_encoded`), against the padded view + per-head mask + SDPA it replaces (the reference)."""

import pytest
import torch

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.head_store import HeadStore, RaggedHeads
from hf_kvcompress.generation import prefill
from hf_kvcompress.hf.compat import cache_kwargs
from hf_kvcompress.ops import cpu_decode

from .tiny_models import kvzip_forced_logits, left_padded, tiny_model

if not cpu_decode.available():
    pytest.skip("the CPU kernel cannot be built here (no C++ compiler?)", allow_module_level=True)

REPEAT = [5, 6, 7]
SPECS = {
    "int4": "kvzip:ratio=0.5,decoding=evict+int4:residual_length=2,group_size=16,sink_tokens=0",
    # a residual of 40: the context's newest pairs stay exact through the 36 steps below (until 40 later tokens)
    "int4, exact pairs held": "kvzip:ratio=0.5,decoding=evict+int4:residual_length=40,group_size=16",
    # int4's and int2's own 4 exact sinks and Hadamard rotation (the plain names', as the byte plans store pairs)
    "int4, codec sinks": "kvzip:ratio=0.5,decoding=evict+int4:residual_length=4,group_size=16",
    "int2": "kvzip:ratio=0.5,decoding=evict+int2:residual_length=4,group_size=16",
    "fp8": "kvzip:ratio=0.5,decoding=evict+fp8",
}


def _ids(n, seed, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _reference(self, query, scaling):
    """The padded view + per-head mask + SDPA that `attend_encoded` replaces, as the layer's unfused step reads."""
    keys, values = self.full("key"), self.full("value")
    mask = self.mask(1, keys.shape[-2])
    groups = query.shape[1] // self.kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
        attn_mask=mask.repeat_interleave(groups, 1), scale=scaling,
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", SPECS)
def test_a_kernel_step_equals_the_padded_view_and_mask(name, dtype):
    """Store by store, step by step (a padded batch of two rows that evict at different steps, blocks of tokens
    joining the pairs, a tail token a row evicted): the kernel's output equals SDPA over the padded view and mask,
    and the bytes held stay what the store promises (nothing of the kernel's is held between steps)."""
    model = use_kvcompress_attention(tiny_model("llama")).to(dtype)
    ids, mask = left_padded([_ids(300, seed=15)[0], _ids(200, seed=16)[0]])
    cache = make_cache(SPECS[name], model.config)
    with torch.inference_mode():
        prefill(model, ids, mask, cache, repeat_prompt_ids=REPEAT)
    g = torch.Generator().manual_seed(4)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    stores = [layer.store for layer in cache.layers]
    assert all(isinstance(store, HeadStore) and store.attends_encoded for store in stores)
    exact_seen = sinks_seen = False
    for step in range(36):
        for layer, store in zip(cache.layers, stores, strict=True):
            key, value = (torch.randn(2, layer.kv_heads, 1, layer.head_dim, generator=g).to(dtype) for _ in range(2))
            query = torch.randn(2, 4, 1, layer.head_dim, generator=g).to(dtype)
            store.append(key, value)
            if step == 20:  # row 1 evicts its oldest recent token (`hold_allowance`, when its pairs are spent)
                store.tail_valid[1, 0] = False
                store.tail_dropped = True
            exact_seen |= store.exact is not None and store.exact.most > 0
            sinks_seen |= store.sink_valid is not None
            got = store.attend_encoded(query, 0.3)
            torch.testing.assert_close(got, _reference(store, query, 0.3), rtol=tolerance, atol=tolerance)
            store.compress(layer.policy, layer.seen + step + 1)
            assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert (sinks_seen or "sinks" not in name) and (exact_seen or "exact" not in name)
    assert not sinks_seen or "sink_tokens=0" not in SPECS[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["int4", "int4, codec sinks", "fp8"])
def test_decode_logits_equal_the_reference_path(name, dtype, monkeypatch):
    """Whole decode steps of the model (teacher-forced, 79 steps, a padded batch): the kernel path's logits equal
    the padded view's, every decode step of every layer takes the kernel, and the bytes are the promise."""
    model = use_kvcompress_attention(tiny_model("llama")).to(dtype)
    ids, mask = left_padded([_ids(300, seed=15)[0], _ids(200, seed=16)[0]])
    tokens = _ids(79, seed=17, batch=2)
    calls = []
    original = cpu_decode.decode_attention
    monkeypatch.setattr(cpu_decode, "decode_attention",
                        lambda *a, **k: calls.append(k.get("spans") is not None) or original(*a, **k))
    cache = make_cache(SPECS[name], model.config)
    fast = kvzip_forced_logits(model, ids, mask, cache, tokens)
    assert calls == [True] * (len(cache.layers) * 80)  # the prompt probed our attention: every decode step fused
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    monkeypatch.setattr(HeadStore, "attends_encoded", property(lambda self: False))
    reference = kvzip_forced_logits(model, ids, mask, make_cache(SPECS[name], model.config), tokens)
    assert len(calls) == len(cache.layers) * 80
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast, reference, rtol=tolerance, atol=tolerance)


def test_greedy_generate_from_transformers_takes_the_kernel_and_gives_the_reference_tokens(monkeypatch):
    """The quick start's path: a model from transformers, `make_cache(spec, model.config)`, KVzip's `prefill` and
    plain `model.generate(cache=...)`, nothing else called: decode steps read the pairs through the kernel (by spans,
    never decoding the pairs' padded view) and give the tokens the padded view gives, in a padded batch."""
    model = tiny_model("llama")
    ids, mask = left_padded([_ids(40, seed=3)[0], _ids(29, seed=4)[0]])
    spans, padded = [], []
    original_spans, original_padded = RaggedHeads.spans, RaggedHeads.padded
    monkeypatch.setattr(RaggedHeads, "spans", lambda self: spans.append(1) or original_spans(self))
    monkeypatch.setattr(RaggedHeads, "padded", lambda self, codec, *a, **k: padded.append(codec.lossless)
                        or original_padded(self, codec, *a, **k))

    def run():
        cache = make_cache("kvzip:ratio=0.5+int4:residual_length=4,group_size=16", model.config)
        with torch.inference_mode():  # KVzip's pass over the document, then transformers' generate
            prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=REPEAT)
            out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=12,
                                 do_sample=False)
        assert all(isinstance(layer.store, HeadStore) for layer in cache.layers)
        return out

    fast = run()
    # The prompt's last token and 11 more, one at a time: every decode step of both layers (the prompt's steps
    # probed our attention, store_offer.py), none through the padded view.
    assert len(spans) == 2 * 12
    assert all(padded)  # the only padded views were the exact pairs' (the lossless view): no encoded pair decoded
    monkeypatch.setattr(HeadStore, "attends_encoded", property(lambda self: False))
    assert torch.equal(fast, run())


@pytest.mark.parametrize("spec", [SPECS["int4"], SPECS["int4, codec sinks"]])
def test_padded_rows_equal_rows_alone(spec):
    """A padded batch through the kernel: each row's greedy tokens are the row's alone (the kernel sums a row's
    own products in a fixed order)."""
    from hf_kvcompress.generation import generate

    model = use_kvcompress_attention(tiny_model("llama"))
    rows = [_ids(300, seed=15)[0], _ids(200, seed=16)[0]]
    ids, mask = left_padded(rows)
    batched = generate(model, ids, mask, make_cache(spec, model.config), max_new_tokens=40,
                       repeat_prompt_ids=REPEAT).new_tokens
    for i, row in enumerate(rows):
        alone = generate(model, row[None], None, make_cache(spec, model.config), max_new_tokens=40,
                         repeat_prompt_ids=REPEAT).new_tokens
        assert torch.equal(batched[i], alone[0]), f"row {i}"


def test_a_store_without_pairs_or_off_the_cpu_kernel_takes_the_padded_view(monkeypatch):
    """The kernel reads a lossy store on a CPU where it is built and while the store holds pairs; otherwise (no
    compiler, a lossless codec, no pair) the padded view and mask serve."""
    model = use_kvcompress_attention(tiny_model("llama"))
    cache = make_cache(SPECS["int4"], model.config)
    with torch.inference_mode():
        prefill(model, _ids(100, seed=2), None, cache, repeat_prompt_ids=REPEAT)
        model(input_ids=_ids(1, seed=3), **cache_kwargs(cache))
    store = cache.layers[0].store
    assert isinstance(store, HeadStore) and store.attends_encoded
    store._encoded.evict_lowest([store._encoded.pairs])  # every finite-scored pair
    assert store._encoded.pairs == 0 and not store.attends_encoded
    lossless = make_cache("kvzip:ratio=0.5", model.config)
    with torch.inference_mode():
        prefill(model, _ids(100, seed=2), None, lossless, repeat_prompt_ids=REPEAT)
    assert not lossless.layers[0].store.attends_encoded
    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    fresh = make_cache(SPECS["int4"], model.config)
    with torch.inference_mode():
        prefill(model, _ids(100, seed=2), None, fresh, repeat_prompt_ids=REPEAT)
    assert not fresh.layers[0].store.attends_encoded
