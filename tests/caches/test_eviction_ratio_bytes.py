"""A plain ratio of the attention-scored policies holds that share of the uncompressed cache's bytes after the
prompt (Expected Attention held 0.598 at a half on SmolLM2: the 64 queries it kept between steps, docs/results.md)."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache, prefill, use_kvcompress_attention
from hf_kvcompress.measure import measured_kv_bytes, served_kv_bytes

from .tiny_models import tiny_model

TOKENS = 400


@pytest.mark.parametrize("spec,share", [("expected_attention:ratio=0.5", 0.5), ("expected_attention:ratio=0.25", 0.25),
                                        ("expected_attention:ratio=0.125", 0.125), ("snapkv:ratio=0.25", 0.25)])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_ratio_holds_its_share_of_the_bytes(spec, share, batch):
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (batch, TOKENS), generator=torch.Generator().manual_seed(4))
    cache, dynamic = make_cache(spec, model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, ids, None, cache)
        prefill(model, ids, None, dynamic)
    kept = -(-TOKENS * share // 1)  # ceil: a ratio keeps ceil(R x seen) per row
    assert all(layer.stored_tokens == kept for layer in cache.layers)
    reference = served_kv_bytes(dynamic, torch.bfloat16)
    pair = reference // TOKENS  # one token's keys and values over every layer, batch and head
    # SnapKV keeps one float32 score per kept slot and head beside its pairs; Expected Attention keeps nothing.
    scores = 4 * batch * sum(layer.kv_heads for layer in cache.layers) * kept if spec.startswith("snapkv") else 0
    bookkeeping = 64 * len(cache.layers)  # each layer's per-row counts (int64)
    held = served_kv_bytes(cache, torch.bfloat16)
    assert kept * pair + scores <= held <= kept * pair + scores + bookkeeping, (held, kept * pair)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()


QUESTION = 24


@pytest.mark.parametrize("share", [0.5, 0.25])
@pytest.mark.parametrize("batch", [1, 2])
def test_expected_attention_appends_the_question_to_the_documents_share(share, batch):
    """`decoding="append"` holds R of the document, then the question whole (kvpress's pipeline); `decoding="evict"`
    scores the question as a step of its own and holds R of document + question."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (batch, TOKENS + QUESTION), generator=torch.Generator().manual_seed(5))
    document, question = ids[:, :TOKENS], ids[:, TOKENS:]
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, document, None, dynamic)
    pair = served_kv_bytes(dynamic, torch.bfloat16) // TOKENS
    bookkeeping = 64 * len(dynamic.layers)
    kept = -(-TOKENS * share // 1)
    for decoding, after_question in (("append", kept + QUESTION), ("evict", -(-(TOKENS + QUESTION) * share // 1))):
        cache = make_cache(f"expected_attention:ratio={share},decoding={decoding}", model.config)
        with torch.no_grad():
            prefill(model, document, None, cache)
            after_document = served_kv_bytes(cache, torch.bfloat16)
            prefill(model, question, None, cache, compress=False)
        assert all(layer.stored_tokens == after_question for layer in cache.layers), decoding
        if decoding == "append":
            assert kept * pair <= after_document <= kept * pair + bookkeeping
            held = served_kv_bytes(cache, torch.bfloat16)
            assert after_question * pair <= held <= after_question * pair + bookkeeping
            assert cache.get_seq_length() == TOKENS + QUESTION


def test_the_question_is_scored_when_prefilled_as_part_of_the_prompt():
    """Only a prefill that says so (compress=False, as generate() feeds a question) appends unscored: the same tokens
    prefilled as the prompt's next chunk are scored and evicted to the ratio."""
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, TOKENS + QUESTION), generator=torch.Generator().manual_seed(6))
    cache = make_cache("expected_attention:ratio=0.25", model.config)
    with torch.no_grad():
        prefill(model, ids[:, :TOKENS], None, cache)
        prefill(model, ids[:, TOKENS:], None, cache)
    assert all(layer.stored_tokens == -(-(TOKENS + QUESTION) // 4) for layer in cache.layers)


def test_generate_appends_the_question_after_a_compressed_document():
    """The eval's path: generate() on a cache that holds the compressed document prefills the question with
    compress=False, so Expected Attention keeps R of the document, then every question and generated token."""
    from hf_kvcompress.generation import generate

    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, TOKENS + QUESTION), generator=torch.Generator().manual_seed(7))
    cache = make_cache("expected_attention:ratio=0.25", model.config)
    with torch.no_grad():
        prefill(model, ids[:, :TOKENS], None, cache)
    generate(model, ids, None, cache, max_new_tokens=3, min_new_tokens=3)
    # The last generated token is returned, not fed: two of the three reach the cache.
    assert all(layer.stored_tokens == TOKENS // 4 + QUESTION + 2 for layer in cache.layers)
