"""A left-padded batch through transformers' own generate() with eviction, on the embedded model.

The case that broke: generate() in transformers 5.24 gives padding position 0, so the cache took the 469 padding
slots of the short row for tokens and kept four of them as its attention sinks; the row then answered
"Sum\\nText in one sentence." instead of "The article discusses ...". Padding here is larger than the budget.
With a chunked prefill the chunks must also split each padded row where they split the row alone.
"""

from pathlib import Path

import pytest
import torch

from hf_kvcompress import make_cache
from hf_kvcompress.generation import generate

# Fixed prose (the first 3,200 characters of the README at bc9ec69), so that editing the README changes no input here.
TEXT = Path(__file__).resolve().parent / "data" / "prompt_text.md"


@pytest.fixture(scope="module")
def batch(embedded):
    _, tokenizer = embedded
    text = TEXT.read_text()
    ask = "\nSummarize the text in one sentence."
    prompts = [text[:900] + ask, text[1000:3200] + ask]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    rows = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    return encoded.input_ids, encoded.attention_mask, rows


def _generate(model, tokenizer, ids, mask, spec, chunk):
    out = model.generate(input_ids=ids, attention_mask=mask, cache=make_cache(spec, model.config), max_new_tokens=16,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id, prefill_chunk_size=chunk)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("spec,chunk", [
    ("sink_window:sink_tokens=4,window=64", None),
    ("h2o:budget=68,recent=32,sink_tokens=4", None),
])
def test_padded_row_answers_as_it_does_alone(embedded, batch, spec, chunk):
    model, tokenizer = embedded
    ids, mask, rows = batch
    pads = (mask == 0).sum(-1)
    assert pads[0] > 400 and pads[1] == 0  # more padding than the 68-token budget
    batched = _generate(model, tokenizer, ids, mask, spec, chunk)
    for i, row in enumerate(rows):
        alone = _generate(model, tokenizer, row, torch.ones_like(row), spec, chunk)
        assert torch.equal(batched[i], alone[0]), (i, tokenizer.decode(batched[i]), tokenizer.decode(alone[0]))


SPEC = "sink_window:sink_tokens=4,window=64"


def test_chunks_counted_from_the_start_warn_when_they_split_padded_rows(embedded, batch):
    """generate(prefill_chunk_size=256) starts the padded row's first real chunk mid-way: it evicts at other
    tokens than the row alone does (the row then answered "... in Spanish" instead of "... in Russian")."""
    model, tokenizer = embedded
    ids, mask, _ = batch
    with pytest.warns(UserWarning, match="chunks counted from its start"):
        _generate(model, tokenizer, ids, mask, SPEC, 256)


def test_chunks_counted_from_the_end_keep_padded_rows_equal_to_rows_alone(embedded, batch, recwarn):
    """hf_kvcompress's prefill counts chunks back from the prompt's end, so left padding moves no boundary."""
    model, tokenizer = embedded
    ids, mask, rows = batch

    def run(input_ids, attention_mask):
        cache = make_cache(SPEC, model.config)
        return generate(model, input_ids, attention_mask, cache, max_new_tokens=16, prefill_chunk_size=256).new_tokens

    batched = run(ids, mask)
    for i, row in enumerate(rows):
        alone = run(row, torch.ones_like(row))
        assert torch.equal(batched[i], alone[0]), (i, tokenizer.decode(batched[i]), tokenizer.decode(alone[0]))
    assert not [w for w in recwarn if "chunks counted" in str(w.message)]
