"""Run a model with a given cache: chunked prefill, greedy or sampled decoding, and timings.

Separating prefill from decoding is what lets an evaluation compress a document before the question arrives,
which is how a served cache sees its prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .caches.eviction import APPENDED_PROMPT
from .caches.layer import END_ALIGNED_CHUNKS
from .hf.compat import assisted_decoding_continues_cache, cache_kwargs, text_config
from .measure import measured_kv_bytes
from .persist import check_model


@dataclass
class GenerationResult:
    """Tokens generated and what producing them cost."""

    sequences: torch.Tensor  # [B, prompt + new]
    new_tokens: torch.Tensor  # [B, new]
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    kv_bytes: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("inf")

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("inf")


REPEAT_INSTRUCTION = "Repeat the previous context exactly."


class RepeatPrompt(list):
    """KVzip's reconstruction prompt, token ids (a list, as the pass always took), and `context_prefix`: the chat
    template's tokens before the user's text (the system turn and the start of the user's).

    The pass repeats a row's text after that prefix when the row starts with it, as KVzip's own templates and
    kvpress's KVzipPress do: repeated inside the assistant's turn, the template's system turn puts the model in
    another state at the start of the copy, and the document's first tokens then score lower than they do when the
    copy starts at the text (benchmarks/probes/kvzip_scores_vs_kvpress.py). The prefix stays in the cache and is
    scored by the queries that repeat the text, like every other pair."""

    def __init__(self, ids, context_prefix=()):
        super().__init__(ids)
        self.context_prefix = tuple(int(i) for i in context_prefix)


def repeat_prompt_ids(tokenizer, chat: bool | None = None) -> RepeatPrompt:
    """KVzip's reconstruction prompt: the instruction after the context, then (with the chat template; `chat=None`:
    when the tokenizer has one) the end of the user's turn and the start of the assistant's, as KVzip's templates do;
    with the template, its tokens before the user's text as `context_prefix` (see RepeatPrompt).
    """
    suffix, prefix = "\n", ()
    if chat or (chat is None and getattr(tokenizer, "chat_template", None)):
        marker = "\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
        )
        before, suffix = rendered.split(marker, 1)
        prefix = tokenizer(before, add_special_tokens=False).input_ids
    return RepeatPrompt(tokenizer("\n\n" + REPEAT_INSTRUCTION + suffix, add_special_tokens=False).input_ids, prefix)


# no_grad, not inference_mode: tensors made under inference_mode refuse in-place updates outside it, so a cache
# prefilled here could not be continued by transformers' generate() (no_grad) or any forward the caller runs.
@torch.no_grad()
def prefill(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    chunk_size: int | None = None,
    *,
    compress: bool = True,
    repeat_prompt_ids: list[int] | None = None,
    reconstruction_chunk: int = 2048,
    reconstruction_overlap: int = 8,
    on_chunk=None,
):
    """Feed `input_ids` into `cache` (after what it already holds), in chunks of `chunk_size` tokens.

    `attention_mask` covers everything the cache has seen plus `input_ids`, as in generate(). Returns the logits
    of the last position. When the cache's policy scores by reconstruction (KVzip) and `compress` is true, the
    model then reads `repeat_prompt_ids` and `input_ids` again (in chunks of `reconstruction_chunk` tokens, each
    after the previous chunk's last `reconstruction_overlap` tokens) against the cache, which scores and evicts:
    about one more prefill of the context, whose tokens are not kept. `on_chunk()` runs after every forward pass
    (to measure memory). KVzap with head budgets ranks every layer's probe-scored pairs once the chunks are read
    (`cache.rank_prompt`). Every other policy compresses while the tokens arrive; with `compress=False` (tokens
    after a compressed document: a question) a policy that `appends_question` (Expected Attention's
    `decoding="append"`) appends them unscored, as kvpress's pipeline appends the question.
    """
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    check_model(cache, model)
    policy = getattr(cache, "policy", None)
    reconstruct = compress and getattr(policy, "scores_by_reconstruction", False)
    past = cache.get_seq_length()
    if reconstruct and past > 0:
        raise ValueError(
            f"{type(policy).__name__} scores a context prefilled in one call, but this cache already holds {past} "
            "tokens; prefill the whole context at once, or pass compress=False to append tokens unscored"
        )
    if reconstruct and not repeat_prompt_ids:
        raise ValueError(
            f"{type(policy).__name__} needs repeat_prompt_ids (its reconstruction prompt): pass "
            "repeat_prompt_ids=hf_kvcompress.generation.repeat_prompt_ids(tokenizer)"
        )
    total = past + input_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones(input_ids.shape[0], total, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape[1] != total:
        raise ValueError(
            f"attention_mask must cover the cached tokens plus input_ids ({total} positions), "
            f"got {attention_mask.shape[1]}"
        )
    # Positions count real tokens only; padding sits at position 1 (generate() in transformers 5.24 puts it at 0:
    # the caches read padding from either layout).
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    # Chunks are counted back from the prompt's end (the first one takes the remainder): left padding then shifts
    # no row's chunk boundaries, so a cache that evicts between chunks treats a padded row as it treats the row
    # alone. (generate(prefill_chunk_size=...) counts from the start; the caches warn when that splits rows.)
    length = input_ids.shape[1]
    step = chunk_size or max(length, 1)
    bounds = [0, *range(length % step or step, length + 1, step)]
    logits = None
    marker = END_ALIGNED_CHUNKS.set(True)
    appended = APPENDED_PROMPT.set(not compress)
    try:
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            out = model(
                input_ids=input_ids[:, start:end],
                attention_mask=attention_mask[:, : past + end],
                position_ids=position_ids[:, past + start : past + end],
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(cache),
            )
            logits = out.logits[:, -1, :]
            for layer in getattr(cache, "layers", []):
                getattr(layer, "check_mask_used", lambda: None)()
            if on_chunk is not None:
                on_chunk()
    finally:
        APPENDED_PROMPT.reset(appended)
        END_ALIGNED_CHUNKS.reset(marker)
    if compress and getattr(policy, "ranks_prompt", False):
        cache.rank_prompt()  # KVzap's head budgets: the prompt is read, rank every layer's pairs once
    if reconstruct:
        score_by_reconstruction(
            model, input_ids, attention_mask, cache, repeat_prompt_ids, reconstruction_chunk, reconstruction_overlap,
            on_chunk,
        )
    return logits


def _check_absolute_positions(config, total: int) -> None:
    """Models with learned absolute positions (GPT-2) have no position beyond their table; RoPE models run on."""
    decoder = text_config(config)
    limit = getattr(decoder, "max_position_embeddings", None)
    if getattr(decoder, "rope_parameters", None) is None and limit is not None and total > limit:
        raise ValueError(
            f"prompt + max_new_tokens = {total} tokens exceeds this model's {limit} learned positions; "
            "no cache can extend them: shorten the prompt or max_new_tokens"
        )


def score_by_reconstruction(model, input_ids, attention_mask, cache, prompt_ids, chunk, overlap, on_chunk) -> None:
    """KVzip's scoring pass (arXiv:2505.23416, Sec. 3.2): each row repeats its own real tokens, chunk by chunk,
    from after the chat template's prefix when the row starts with it (`prompt_ids.context_prefix`, RepeatPrompt).

    Rows of a padded batch are split at the same offsets from their first repeated token as they would be alone; a
    chunk shorter than the batch's longest is padded on the right (so its tokens sit right after the cache, as
    alone, which sliding-window masks count in slots), and its padding queries are left out of the scores.
    """
    if chunk <= 0 or overlap < 0:
        raise ValueError(f"reconstruction_chunk must be > 0 and reconstruction_overlap >= 0, got {chunk}, {overlap}")
    device = input_ids.device
    rows = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask[:, -input_ids.shape[1] :], strict=True)]
    prefix = torch.as_tensor(getattr(prompt_ids, "context_prefix", ()), dtype=torch.long, device=device)
    if len(prefix):  # a row that starts with the template's prefix repeats only what follows it
        rows = [
            row[len(prefix) :] if len(row) > len(prefix) and torch.equal(row[: len(prefix)], prefix) else row
            for row in rows
        ]
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    real_seen = attention_mask.long().sum(-1)  # [B] real tokens in the cache: positions continue from there
    pad_id = 0
    cache.begin_reconstruction()
    completed = False
    try:
        for start in range(0, max(len(r) for r in rows), chunk):
            pieces = []
            for row in rows:
                piece = row[start : start + chunk]
                pieces.append(torch.cat([prompt, row[max(start - overlap, 0) : start], piece]) if len(piece) else piece)
            width = max(len(p) for p in pieces)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
            real = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            for i, piece in enumerate(pieces):
                if len(piece):
                    ids[i, : len(piece)] = piece
                    real[i, : len(piece)] = 1
            positions = (real_seen[:, None] + real.cumsum(-1) - 1).masked_fill(real == 0, 1)
            cache.reconstruction_queries(real.bool())
            model(
                input_ids=ids,
                attention_mask=torch.cat([attention_mask, real], dim=1),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(cache),
            )
            for layer in getattr(cache, "layers", []):
                getattr(layer, "check_attention_served", lambda: None)()
            if on_chunk is not None:
                on_chunk()
        completed = True
    finally:
        cache.end_reconstruction(evict=completed)


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()  # see prefill
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    max_new_tokens: int = 32,
    streamer=None,
    prefill_chunk_size: int | None = None,
    repeat_prompt_ids: list[int] | None = None,
    **generate_kwargs,
) -> GenerationResult:
    """generate() with `cache`, timing prefill and decoding separately.

    The prompt (whatever part of it the cache has not seen yet) is prefilled first, then generate() continues from
    the cache, which slices off what the cache already holds; so does speculative decoding
    (`prompt_lookup_num_tokens=`, `assistant_model=`: see `assisted_decoding_continues_cache` in hf/compat.py).
    `repeat_prompt_ids`: see `prefill` (KVzip).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive number of tokens, got {max_new_tokens}")
    check_model(cache, model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = input_ids.device
    seen = cache.get_seq_length()
    new_prompt = input_ids.shape[1] - seen
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: a prompt needs at least one token (e.g. the BOS token)")
    if new_prompt < 1:
        raise ValueError(f"input_ids must extend what the cache already holds ({seen} tokens)")
    _check_absolute_positions(model.config, input_ids.shape[1] + max_new_tokens)
    sync(device)
    start = time.perf_counter()
    # Beam search expands the batch inside generate(), so the prompt must be prefilled there (untimed apart).
    separate_prefill = generate_kwargs.get("num_beams", 1) == 1
    if not separate_prefill and prefill_chunk_size is not None:
        generate_kwargs["prefill_chunk_size"] = prefill_chunk_size
    if separate_prefill and new_prompt > 1:  # leave the last prompt token to generate(), which needs one input
        # A fresh prompt is compressed as a context (KVzip reads it again); tokens added to a cache that already
        # holds a compressed document (a question) are appended as they are.
        prefill(
            model, input_ids[:, seen:-1], attention_mask[:, :-1], cache, chunk_size=prefill_chunk_size,
            compress=seen == 0, repeat_prompt_ids=repeat_prompt_ids,
        )
    sync(device)
    prefill_seconds = time.perf_counter() - start if separate_prefill else float("nan")
    generate_kwargs.setdefault("do_sample", False)
    if not generate_kwargs["do_sample"]:
        generate_kwargs.setdefault("temperature", None)
        generate_kwargs.setdefault("top_p", None)
        generate_kwargs.setdefault("top_k", None)
    pad_id = getattr(model.generation_config, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(model.generation_config, "eos_token_id", None)
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
    start = time.perf_counter()
    with assisted_decoding_continues_cache(model):  # speculative decoding from the prefilled cache, see there
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            pad_token_id=pad_id,
            **cache_kwargs(cache),
            **generate_kwargs,
        )
    sync(device)
    decode_seconds = time.perf_counter() - start
    new_tokens = sequences[:, input_ids.shape[1] :]
    return GenerationResult(
        sequences=sequences,
        new_tokens=new_tokens,
        prefill_tokens=new_prompt * input_ids.shape[0],
        prefill_seconds=prefill_seconds,
        decode_tokens=new_tokens.shape[1] * input_ids.shape[0],
        decode_seconds=decode_seconds,
        kv_bytes=measured_kv_bytes(cache),
    )
