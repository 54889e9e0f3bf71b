"""lm-eval model `hf-kvcompress`: a transformers model whose every request gets a fresh compressed cache.

    hf-kvcompress lm-eval --model hf-kvcompress --model_args pretrained=,cache=int4 \\
        --tasks kvc_needle --include_path eval_tasks

`--model_args`: `pretrained` (alias, folder or .gguf; empty = the embedded SmolLM2-135M-Instruct; from Python,
also a loaded model with `tokenizer=`), `cache` (a
registry spec, default `dynamic`; one with commas in double quotes: `'cache="h2o:budget=256,recent=64"'`),
`query_aware` (false), `prompt_format` (auto/chat/plain), `chunk_size` (512), `dtype`, and HFLM's own arguments;
any other is refused (HFLM would ignore it). The protocol is the suite's: for the kvc_* tasks the document is
prefilled (and compressed) first and the question appended afterwards, with the same tokens `hf-kvcompress eval`
uses (rendered from the sample's fields, so lm-eval's own prompt string, few-shot examples or chat flag do not apply
to them); consecutive
requests about one document (kvc_multi_question's questions) share one prefill of it, each answered on an
untouched copy of the compressed cache, as `hf-kvcompress eval` answers them. Any other
generation task prefills its whole context into the cache before decoding; loglikelihood requests prefill the
context, then score the continuation from the compressed cache.

lm-eval's CLI discovers no plugins: call `register()` (the `hf-kvcompress lm-eval` command does) before it runs.
"""

from __future__ import annotations

import inspect

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from ..generation import prefill, repeat_prompt_ids
from ..hf.compat import cache_kwargs
from ..models import load_model
from ..registry import bounds_memory, make_cache, parse_spec
from .prompts import PromptFormat, encode, protocol_name
from .runner import CompressedDocument, first_item

MODEL_NAME = "hf-kvcompress"
_SAMPLE_FIELDS = ("instruction", "document", "question", "references")


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def _parameters(function) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds and p.name != "self"]


def _refuse_unknown(kwargs: dict) -> None:
    """Model arguments that neither this model nor HFLM names are refused: HFLM would drop them without a word."""
    unknown = [name for name in kwargs if name not in _parameters(HFLM.__init__)]
    if not unknown:
        return
    given = ", ".join(f"{name}={kwargs[name]}" for name in unknown)
    raise ValueError(
        f"unknown model argument{'s' if len(unknown) > 1 else ''} {given} for --model {MODEL_NAME}; its own are "
        f"{', '.join(_parameters(KVCompressLM.__init__))}, and lm-eval's HFLM takes "
        f"{', '.join(p for p in _parameters(HFLM.__init__) if p not in _parameters(KVCompressLM.__init__))}. "
        "lm-eval splits --model_args at every comma outside quotes, so a cache spec with commas goes in double "
        """quotes: --model_args 'pretrained=,cache="h2o:budget=256,recent=64"' (or JSON: --model_args """
        """'{"cache": "h2o:budget=256,recent=64"}'; from Python, model_args as a dict)"""
    )


class KVCompressLM(HFLM):
    """HFLM that runs every request from a fresh cache built from `cache` (or an untouched copy of the last
    request's, when that request had the same document)."""

    def __init__(
        self,
        pretrained=None,
        cache: str = "dynamic",
        query_aware: bool | str = False,
        prompt_format: PromptFormat = "auto",
        chunk_size: int | str | None = 512,
        device: str | None = None,
        dtype: str | None = None,
        **kwargs,
    ) -> None:
        _refuse_unknown(kwargs)  # e.g. `recent=64`, split off an unquoted `cache=h2o:budget=256,recent=64`
        parse_spec(cache)  # a bad spec fails here, before the model loads
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's CLI defaults to cuda:0 even on machines without one
        dtype = None if dtype in (None, "auto") else dtype
        if pretrained is None or isinstance(pretrained, str):
            model, tokenizer = load_model(pretrained or None, device=device, dtype=dtype)
            kwargs.pop("tokenizer", None)
        else:  # a loaded model (Python API): pass its tokenizer too
            model, tokenizer = pretrained, kwargs.pop("tokenizer")
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        self.cache_spec = cache
        self.query_aware = _flag(query_aware)
        self.prompt_format = prompt_format
        self.chunk_size = int(chunk_size) if chunk_size not in (None, "", "none", "None") else None
        self.protocol = protocol_name(self.query_aware)  # document_first or query_aware, as the runner records
        self.last_document: tuple[list[int], CompressedDocument] | None = None

    def compressed(self, document_ids: list[int], pad_id: int) -> CompressedDocument:
        """The document prefilled (and compressed) into a fresh cache, kept for the next request about it."""
        if self.last_document is None or self.last_document[0] != document_ids:
            document = CompressedDocument(self.model, self.cache_spec, [document_ids], pad_token_id=pad_id,
                                          chunk_size=self.chunk_size,
                                          repeat_prompt_ids=repeat_prompt_ids(self.tokenizer))  # fmt: skip
            self.last_document = (list(document_ids), document)
        return self.last_document[1]

    def _rows(self, request: Instance) -> tuple[list[int], list[int], int | None]:
        """(document_ids, question_ids, max_new_tokens of the sample or None) for one request."""
        doc = getattr(request, "doc", None)
        if isinstance(doc, dict) and all(name in doc for name in _SAMPLE_FIELDS):
            document_ids, question_ids = encode(
                self.tokenizer, doc, query_aware=self.query_aware, prompt_format=self.prompt_format
            )
            return document_ids, question_ids, doc.get("max_new_tokens")
        # Any other task: no document/question split is known, so the whole context goes in first.
        ids = self.tok_encode(request.args[0]) or [self.prefix_token_id]
        return ids[:-1], ids[-1:], None

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = first_item(self.model.generation_config.eos_token_id)
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc=f"generate ({self.cache_spec})"):
            context, gen_kwargs = request.args
            document_ids, question_ids, sample_max = self._rows(request)
            max_new = sample_max or int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            output = self.compressed(document_ids, pad_id).answer([question_ids], max_new, copy=True)
            text = self.tokenizer.decode(output.new_tokens[0], skip_special_tokens=True)
            for stop in gen_kwargs.get("until") or []:
                if stop and stop in text:
                    text = text.split(stop)[0]
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        self.last_document = None  # the cache's memory goes with the requests
        return results

    @torch.inference_mode()
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        progress = tqdm(requests, disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood ({self.cache_spec})")
        for request in progress:
            context, continuation = request.args
            if context == "":
                context_ids, continuation_ids = [self.prefix_token_id], self.tok_encode(continuation)
            else:
                context_ids, continuation_ids = self._encode_pair(context, continuation)
            cache = make_cache(self.cache_spec, self.model.config)
            step = self.chunk_size if self.chunk_size and bounds_memory(self.cache_spec) else None
            device = self.model.device
            ids = torch.tensor([context_ids], device=device)
            last = prefill(self.model, ids, None, cache, chunk_size=step,  # [1, V]: predicts continuation[0]
                           repeat_prompt_ids=repeat_prompt_ids(self.tokenizer))
            logits = [last]
            if len(continuation_ids) > 1:
                rest = torch.tensor([continuation_ids[:-1]], device=device)
                seen = cache.get_seq_length()
                out = self.model(
                    input_ids=rest,
                    attention_mask=torch.ones(1, seen + rest.shape[1], dtype=torch.long, device=device),
                    position_ids=torch.arange(seen, seen + rest.shape[1], device=device)[None],
                    use_cache=True,
                    **cache_kwargs(cache),
                )
                logits.append(out.logits[0])
            logprobs = torch.log_softmax(torch.cat(logits, dim=0).float(), dim=-1)  # [n, V]
            target = torch.tensor(continuation_ids, device=device)
            total = logprobs.gather(-1, target[:, None]).sum().item()
            greedy = bool((logprobs.argmax(-1) == target).all())
            results.append((total, greedy))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (total, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "hf-kvcompress scores generation and loglikelihood tasks; rolling perplexity is not supported"
        )


def register() -> str:
    """Register `hf-kvcompress` with lm-eval's model registry (idempotent); returns the name."""
    if model_registry.get(MODEL_NAME, None) is not KVCompressLM:
        register_model(MODEL_NAME)(KVCompressLM)
    return MODEL_NAME
