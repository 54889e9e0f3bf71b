"""The protocol: the cache holds exactly the document (already compressed) when the question arrives."""

import pytest

from hf_kvcompress.eval import encode, runner

WINDOW = "sink_window:sink_tokens=4,window=64"


def _spy(monkeypatch):
    """Record the tokens each prefill call feeds, and the cache's state when generate() receives the question."""
    log = {"document": [], "at_question": None}
    real_prefill, real_generate = runner.prefill, runner.generate

    def prefill(model, input_ids, attention_mask, cache, chunk_size=None, **kwargs):
        log["document"].extend(input_ids[0].tolist())
        return real_prefill(model, input_ids, attention_mask, cache, chunk_size=chunk_size, **kwargs)

    def generate(model, input_ids, attention_mask, cache, **kwargs):
        seen = cache.get_seq_length()
        log["at_question"] = (seen, runner.tokens_per_layer(cache), input_ids[0, seen:].tolist())
        return real_generate(model, input_ids, attention_mask, cache, **kwargs)

    monkeypatch.setattr(runner, "prefill", prefill)
    monkeypatch.setattr(runner, "generate", generate)
    return log


@pytest.mark.parametrize("query_aware", [False, True])
def test_question_is_appended_after_the_document_was_compressed(embedded, small_samples, monkeypatch, query_aware):
    model, tokenizer = embedded
    row = small_samples[0]
    document_ids, question_ids = encode(tokenizer, row, query_aware=query_aware)
    log = _spy(monkeypatch)
    runner.run_batch(model, WINDOW, [(document_ids, question_ids)], 4, pad_token_id=tokenizer.pad_token_id,
                     chunk_size=128)
    # Everything prefilled before generate() is the document part, in chunks, and nothing else.
    assert log["document"] == document_ids
    seen, stored, question = log["at_question"]
    assert seen == len(document_ids) and question == question_ids
    assert stored <= 4 + 64 < len(document_ids)  # compressed before the question existed
    document_text = tokenizer.decode(document_ids)
    assert (row["question"] in document_text) is query_aware
    assert row["question"] in tokenizer.decode(question_ids)


def test_records_say_which_protocol_was_used(embedded, small_samples):
    model, tokenizer = embedded
    one = small_samples.select([0])
    plain = runner.run_eval(model, tokenizer, [], samples=one, progress=False)
    aware = runner.run_eval(model, tokenizer, [], samples=one, query_aware=True, progress=False)
    assert [r["protocol"] for r in plain] == ["document_first"]
    assert [r["protocol"] for r in aware] == ["query_aware"]
    assert aware[0]["document_tokens"] > plain[0]["document_tokens"]


def test_greedy_generation_is_deterministic(embedded, small_samples):
    model, tokenizer = embedded
    rows = [encode(tokenizer, small_samples[0])]
    first = runner.run_batch(model, "dynamic", rows, 6, pad_token_id=tokenizer.pad_token_id)
    second = runner.run_batch(model, "dynamic", rows, 6, pad_token_id=tokenizer.pad_token_id)
    assert first.new_tokens == second.new_tokens and first.kv_bytes_peak == second.kv_bytes_peak


def test_a_batch_needs_one_question_length():
    with pytest.raises(ValueError, match="one length"):
        runner.run_batch(None, "dynamic", [([1, 2], [3]), ([1, 2], [3, 4])], 4, pad_token_id=0)


def test_batches_group_question_lengths_and_close_document_lengths():
    encoded = [([0] * 1000, [0] * 9), ([0] * 990, [0] * 9), ([0] * 300, [0] * 9), ([0] * 1000, [0] * 8)]
    ids = ["a", "b", "c", "d"]
    plan = runner.plan_batches(["dynamic", "int4"], encoded, ids, batch_size=4, chunk_size=512)
    assert [(item.method, item.rows) for item in plan] == [
        ("dynamic", [3]), ("dynamic", [0, 1]), ("dynamic", [2]), ("int4", [3]), ("int4", [0, 1]), ("int4", [2]),
    ]
    done = {("int4", "a"), ("dynamic", "d")}
    plan = runner.plan_batches(["dynamic", "int4"], encoded, ids, batch_size=4, chunk_size=512, done=done)
    assert [(item.method, item.rows) for item in plan] == [
        ("dynamic", [0, 1]), ("dynamic", [2]), ("int4", [3]), ("int4", [1]), ("int4", [2]),
    ]
