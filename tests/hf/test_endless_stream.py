"""An endless stream through StreamingLLM (sinks + window, re-rotated keys) on the embedded model.

Once the window is full the cache's measured bytes never change, nothing errors, and the model still models text:
the perplexity of the stream's last tokens stays within a bound of an uncompressed run over the same tokens.
The default run streams 1,000 tokens (8 windows); the soak (`-m slow`) streams 100,000 (12 times SmolLM2's 8k context).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_kvcompress import SinkWindowCache, make_cache, measured_kv_bytes


def _tokens(tokenizer, count):
    from hf_kvcompress.eval.data import essay_words

    words = essay_words()
    ids = tokenizer(" ".join(words[: int(count * 0.9) + 100]), return_tensors="pt").input_ids
    while ids.shape[1] < count:  # the essays hold about 700k tokens; repeat them beyond that
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :count]


@torch.inference_mode()
def stream(model, ids, cache, chunk):
    """Feed `ids` [1, T] chunk by chunk; return each next token's negative log-likelihood and the bytes after each
    chunk."""
    nll, sizes, last = [], [], None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start:start + chunk]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()
        predicted = logits[:-1] if last is None else torch.cat([last[None], logits[:-1]])
        targets = piece[0] if last is not None else piece[0, 1:]
        nll.append(F.cross_entropy(predicted, targets, reduction="none"))
        last = logits[-1]
        sizes.append(measured_kv_bytes(cache))
    return torch.cat(nll), sizes


def _check_stream(embedded, total, window, chunk, tail, reference_context, bound):
    model, tokenizer = embedded
    ids = _tokens(tokenizer, total)
    cache = SinkWindowCache(sink_tokens=4, window=window, config=model.config, rerotate=True)
    nll, sizes = stream(model, ids, cache, chunk)
    assert cache.get_seq_length() == total
    full_from = next(i for i in range(len(sizes)) if (i + 1) * chunk >= 4 + window + chunk)
    assert len(set(sizes[full_from:])) == 1, "bytes must stay constant once the window is full"
    # The reference: no eviction, over the `reference_context` tokens that end where the stream ends.
    reference_ids = ids[:, total - reference_context:]
    reference_nll, _ = stream(model, reference_ids, make_cache("dynamic", model.config), chunk)
    ppl = math.exp(nll[-tail:].mean().item())
    reference_ppl = math.exp(reference_nll[-tail:].mean().item())
    print(f"\n{total} tokens, window {window}: last {tail} tokens perplexity {ppl:.2f}, "
          f"uncompressed over {reference_context} tokens {reference_ppl:.2f}, bytes {sizes[-1]}")
    assert ppl <= bound * reference_ppl


def test_short_stream_keeps_constant_bytes_and_models_text(embedded):
    _check_stream(embedded, total=1000, window=124, chunk=128, tail=300, reference_context=1000, bound=1.5)


@pytest.mark.slow
def test_hundred_thousand_token_soak(embedded):
    _check_stream(embedded, total=100_000, window=1020, chunk=512, tail=1000, reference_context=4000, bound=1.5)
