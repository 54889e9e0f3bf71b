"""StreamingLLM on the real model: memory stays bounded by sinks + window + one chunk, and the text stays fluent."""

import re

import pytest
import torch

from hf_kvcompress import SinkWindowCache
from hf_kvcompress.eval.data import essay_words


def _stream(embedded, tokens, window, chunk, rerotate):
    model, tokenizer = embedded
    words = essay_words()
    ids = tokenizer(" ".join(words[: tokens]), return_tensors="pt").input_ids[:, :tokens]
    cache = SinkWindowCache(sink_tokens=4, window=window, config=model.config, rerotate=rerotate)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, prefill_chunk_size=chunk,
        max_new_tokens=32, do_sample=False,
    )
    new = out[0, ids.shape[1]:]
    return cache, new, tokenizer.decode(new, skip_special_tokens=True)


def _assert_fluent(new, text):
    words = re.findall(r"\S+", text)
    assert len(words) >= 10, text
    assert sum(bool(re.fullmatch(r"[A-Za-z'\-,.;:!?\"()]+", w)) for w in words) / len(words) >= 0.8, text
    assert len(set(new.tolist())) / len(new) >= 0.3, text  # not a one- or two-token loop


def _assert_bounded(cache, window, chunk):
    for layer in cache.layers:
        assert layer.stored_tokens == 4 + window
        assert layer.peak_tokens <= 4 + window + chunk


@pytest.mark.parametrize("rerotate", [False, True])
def test_short_stream_is_bounded_and_fluent(embedded, rerotate):
    cache, new, text = _stream(embedded, tokens=1200, window=192, chunk=256, rerotate=rerotate)
    _assert_bounded(cache, 192, 256)
    _assert_fluent(new, text)


@pytest.mark.slow
def test_twenty_thousand_token_stream_keeps_generating_fluent_text(embedded):
    cache, new, text = _stream(embedded, tokens=20000, window=1024, chunk=512, rerotate=True)
    print(f"\nafter {cache.get_seq_length()} tokens: {text!r}")
    _assert_bounded(cache, 1024, 512)
    _assert_fluent(new, text)
