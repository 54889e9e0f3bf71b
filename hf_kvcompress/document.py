"""Compress a document once, then ask it any number of questions, each on an untouched copy of the cache.

A served cache sees a long document before the user's question. `compress_document` renders the prompt the way the
evaluation does (eval/prompts.py: the chat template for an instruct model, "document, question, Answer:" for a base
model, split where the document ends), prefills the document part into a cache of any spec (KVzip's reconstruction
pass included) and returns a `Document`; `Document.ask` appends each question's part (the end of the user's turn and
the start of the assistant's, for a chat model) to a copy of that cache and decodes the answer. Several questions are
asked in batches, one per question length, each question answered as it is alone. A `Document` is saved and loaded
like any cache (persist.py), its text beside it.

Example::

    model, tokenizer = load_model()
    doc = compress_document(model, tokenizer, text, "kvzip:ratio=0.25+int4")
    doc.ask("Who founded the company?")            # -> "The company was founded by ..."
    doc.ask(["Who?", "When?"])                     # -> ["...", "..."], batched by question length
    doc.save("doc.safetensors"); load_document("doc.safetensors", model, tokenizer).ask("Where?")
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence

import torch
from safetensors import safe_open
from transformers import StoppingCriteria, StoppingCriteriaList

from .caches.compressed import CompressedCache
from .eval.prompts import PROMPT_FORMATS, PromptFormat, encode, uses_chat
from .generation import generate, prefill, repeat_prompt_ids
from .hf.attention import ATTENTION_NAME, use_kvcompress_attention
from .hf.compat import text_config
from .measure import measured_kv_bytes
from .persist import load_cache, save_cache
from .registry import make_cache, needs_attention

__all__ = ["Document", "compress_document", "load_document"]

_METADATA_KEY = "hf_kvcompress.document"  # the saved cache's metadata entry holding the document (JSON)


def _sample(text: str, instruction: str, question: str = "", answer_prefix: str = "") -> dict:
    """The fields eval/prompts.py renders a prompt from."""
    return {"instruction": instruction, "document": text, "question": question, "answer_prefix": answer_prefix}


class Document:
    """A document prefilled (and compressed) once into `cache`, which `ask` never changes.

    Build one with `compress_document` or `load_document`. Attributes: `text`, `instruction`, `prompt_format`,
    `input_ids` (the document part's token ids, as the cache holds them), `cache` and `spec`.
    """

    def __init__(self, model, tokenizer, cache: CompressedCache, text: str, input_ids: list[int], *,
                 instruction: str = "", prompt_format: PromptFormat = "auto"):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.text, self.input_ids = text, list(input_ids)
        self.instruction, self.prompt_format = instruction, prompt_format

    @property
    def spec(self) -> str:
        return self.cache.spec

    @property
    def kv_bytes(self) -> int:
        """Bytes the compressed document holds (measured_kv_bytes)."""
        return measured_kv_bytes(self.cache)

    def __repr__(self) -> str:
        return f"Document({len(self.input_ids)} tokens, spec={self.spec!r}, kv_bytes={self.kv_bytes})"

    def ask(self, question: str | Sequence[str], *, max_new_tokens: int = 64, answer_prefix: str = "",
            **generate_kwargs) -> str | list[str]:
        """The answer to `question` (a string), or to each of a list of questions (a batch per question length, each
        answered as it is alone), as text.

        Args:
            question: a question, or a list of questions answered together.
            max_new_tokens: the most tokens each answer may take.
            answer_prefix: text the answer starts with (given to the model, not returned), e.g. "The year is".
            **generate_kwargs: passed to `model.generate` (greedy by default; `do_sample=True, temperature=...`).
        """
        single = isinstance(question, str)
        questions = [question] if isinstance(question, str) else list(question)
        if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise ValueError(f"question must be a non-empty string or a non-empty list of them, got {question!r}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        for name in ("num_beams", "num_return_sequences"):
            if generate_kwargs.get(name, 1) != 1:
                raise ValueError(
                    f"{name} is not supported by Document.ask (one answer per question), got {generate_kwargs[name]}"
                )
        parts = [self._question_ids(q, answer_prefix) for q in questions]
        answers = self._answer(parts, max_new_tokens, generate_kwargs)
        return answers[0] if single else answers

    def save(self, path: str | os.PathLike) -> None:
        """Write the compressed cache and the document to a safetensors file (read it with `load_document`)."""
        entry = {"text": self.text, "input_ids": self.input_ids, "instruction": self.instruction,
                 "prompt_format": self.prompt_format}
        save_cache(self.cache, path, metadata={_METADATA_KEY: json.dumps(entry)})

    # -- internals ---------------------------------------------------------------------------------------------

    def _question_ids(self, question: str, answer_prefix: str) -> list[int]:
        document_ids, question_ids = encode(
            self.tokenizer, _sample(self.text, self.instruction, question, answer_prefix),
            prompt_format=self.prompt_format,
        )
        if document_ids != self.input_ids:
            raise ValueError(
                "this tokenizer renders the document into other tokens than the cache holds (another tokenizer, or a "
                "chat template that depends on the question): compress the document with this tokenizer"
            )
        return question_ids

    def _answer(self, parts: list[list[int]], max_new_tokens: int, generate_kwargs: dict) -> list[str]:
        """Every question's answer, in the order given: questions of one length decode as one batch.

        A question asked alone is fed to the model in one step after the cached document. A cache that evicts or
        encodes as tokens arrive (KVzip with `decoding=evict`: the context gives way to the question; a lossy codec's
        residual) stores what a step attends to, so a question fed in another split attends to another cache:
        its tokens fed one per step see the context as the earlier ones left it, fed at once all of them see the
        context whole. Rows cannot be padded behind a document the cache already holds (its rows keep padding
        first), so only questions of one length can take that same single step together; each length is a batch.
        """
        eos = _eos_ids(self.model, self.tokenizer, generate_kwargs.pop("eos_token_id", None))
        answers: list[str] = [""] * len(parts)
        for length in sorted({len(p) for p in parts}):
            rows = [i for i, p in enumerate(parts) if len(p) == length]
            for row, answer in zip(rows, self._answer_batch([parts[i] for i in rows], max_new_tokens, eos,
                                                            generate_kwargs), strict=True):
                answers[row] = answer
        return answers

    def _answer_batch(self, parts: list[list[int]], max_new_tokens: int, eos: set[int],
                      generate_kwargs: dict) -> list[str]:
        """Decode the answers to questions of one length in one batch over copies of the document's rows."""
        device = self.model.device
        rows = len(parts)
        cache = copy.deepcopy(self.cache)  # the document stays as compressed, for the next question
        if rows > 1:
            cache.batch_repeat_interleave(rows)
        document = torch.tensor(self.input_ids, dtype=torch.long, device=device).expand(rows, -1)
        ids = torch.cat([document, torch.tensor(parts, dtype=torch.long, device=device)], dim=1)
        # A row ends at any of `eos` (ask's eos_token_id=, else the model's and the tokenizer's): `_Answered` checks
        # them, with transformers' own end-of-sequence check off.
        out = generate(
            self.model, ids, None, cache, max_new_tokens=max_new_tokens, eos_token_id=[],
            stopping_criteria=StoppingCriteriaList([_Answered(ids.shape[1], eos, max_new_tokens)]),
            **generate_kwargs,
        )
        answers = []
        for tokens in out.new_tokens.tolist():
            answer = tokens[:max_new_tokens]
            end = next((i for i, t in enumerate(answer) if t in eos), len(answer))
            answers.append(self.tokenizer.decode(answer[:end], skip_special_tokens=True).strip())
        return answers


class _Answered(StoppingCriteria):
    """A row is done once it has produced an end-of-sequence token (or `max_new_tokens`)."""

    def __init__(self, start: int, eos: set[int], max_new_tokens: int):
        self.start, self.max_new_tokens = start, max_new_tokens
        self.eos = torch.tensor(sorted(eos) or [-1])

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        answered = input_ids.shape[1] - self.start  # tokens of the answer so far
        ended = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device)) & (answered > 0)
        # A bool tensor, as StoppingCriteria declares; torch types BoolTensor as a class of its own.
        return ended | (answered >= self.max_new_tokens)  # type: ignore[return-value]


def _eos_ids(model, tokenizer, given=None) -> set[int]:
    """The tokens that end an answer: `given` (ask's eos_token_id=), else the model's and the tokenizer's."""
    if given is None:
        given = getattr(model.generation_config, "eos_token_id", None)
        ids = set(given) if isinstance(given, (list, tuple)) else ({given} if given is not None else set())
        return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    return set(given) if isinstance(given, (list, tuple)) else {given}


def _serve_attention(model, spec: str) -> None:
    """Give a spec that scores by attention, by KVzip's pass or from hidden states the attention it reads.

    A model running transformers' SDPA is switched to 'kvcompress_sdpa' (the same SDPA call whenever no layer asks
    for more, so nothing else it answers changes) and hooked, as a cache switches it at its first request; any other
    implementation (eager, flash, flex) answers differently under it, so it is refused by name, not switched.
    """
    if not needs_attention(spec):
        return
    running = getattr(text_config(model.config), "_attn_implementation", None)
    if running not in ("sdpa", ATTENTION_NAME):
        raise ValueError(
            f"spec {spec!r} scores tokens by attention (or by KVzip's reconstruction pass), which the model's "
            f"attention {running!r} cannot give: load the model with attn_implementation='sdpa' (load_model's "
            "default), or call hf_kvcompress.use_kvcompress_attention(model) to switch it"
        )
    use_kvcompress_attention(model)


def compress_document(model, tokenizer, text: str, spec: str = "dynamic", *, instruction: str = "",
                      prompt_format: PromptFormat = "auto", chunk_size: int | None = None) -> Document:
    """Prefill `text` into a fresh cache of `spec` (compressing it) and return a `Document` to ask questions.

    Args:
        model, tokenizer: e.g. from `hf_kvcompress.load_model()`.
        text: the document.
        spec: the cache, as a registry spec string (`"dynamic"`, `"int4"`, `"kvzip:ratio=0.25+int4"`, ...).
        instruction: text placed before the document, e.g. "Answer the question from the document.".
        prompt_format: `"auto"` (the chat template when the tokenizer has one), `"chat"` or `"plain"`.
        chunk_size: prefill in chunks of this many tokens (None: at once); KVzip scores the whole document.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string (the document), got {text!r}")
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a cache spec string such as 'kvzip:ratio=0.25+int4', got {type(spec).__name__}")
    if not isinstance(instruction, str):
        raise ValueError(f"instruction must be a string, got {type(instruction).__name__}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    chat = uses_chat(tokenizer, prompt_format)
    input_ids, _ = encode(tokenizer, _sample(text, instruction), prompt_format=prompt_format)
    cache = make_cache(spec, model.config)
    _serve_attention(model, spec)
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    prefill(model, ids, None, cache, chunk_size=chunk_size, repeat_prompt_ids=repeat_prompt_ids(tokenizer, chat=chat))
    return Document(model, tokenizer, cache, text, input_ids, instruction=instruction, prompt_format=prompt_format)


def load_document(path: str | os.PathLike, model, tokenizer, device: str | torch.device | None = None) -> Document:
    """The `Document` that `Document.save` wrote to `path`, on `device` (default: the model's)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if _METADATA_KEY not in metadata:
        raise ValueError(f"{path} holds no document (a cache saved by save_cache?): read it with load_cache")
    entry = json.loads(metadata[_METADATA_KEY])
    cache = load_cache(path, device=device if device is not None else model.device, model=model)
    document = Document(model, tokenizer, cache, entry["text"], entry["input_ids"], instruction=entry["instruction"],
                        prompt_format=entry["prompt_format"])
    rendered, _ = encode(tokenizer, _sample(document.text, document.instruction), prompt_format=document.prompt_format)
    if rendered != document.input_ids:
        raise ValueError(
            f"tokenizer renders the document saved in {path} into other tokens: load it with the tokenizer it was "
            "saved with"
        )
    return document
