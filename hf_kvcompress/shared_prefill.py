"""Run many cache plans on the same samples with one document prefill per sample instead of one per plan.

A cache whose policy does not score by attention, given the whole document in one chunk, receives exactly the
key and value states a DynamicCache receives (attention over the document uses the states as they arrive, before
any encoding or eviction; not so fp8's, which encodes them first, see `needs_own_prefill`). So the document is
prefilled once into a DynamicCache, and each plan's cache is built by handing it those states layer by layer; only
the question and the answer run per plan. KVzip keeps every state until its reconstruction pass scores them, so it
gets the replayed states too and runs only that pass. Plans that score by attention (H2O, SnapKV) need the prefill
itself and are prefilled for real. `tests/test_shared_prefill.py` checks the
answers equal those of a real one-chunk prefill.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .eval.prompts import PromptFormat, encode, protocol_name, uses_chat
from .eval.runner import (
    AttentionSwitch,
    eos_ids,
    first_item,
    left_pad,
    plan_batches,
    run_batch,
    served_name,
    tokens_per_layer,
)
from .eval.scoring import score_all
from .eval.tasks import sample_split
from .generation import generate, prefill, repeat_prompt_ids, score_by_reconstruction
from .measure import measured_kv_bytes, served_kv_bytes
from .registry import make_cache, needs_own_prefill, parse_spec


@torch.inference_mode()
def document_states(model, full_ids: torch.Tensor, full_mask: torch.Tensor, width: int) -> DynamicCache:
    """The document (first `width` tokens) prefilled once into a DynamicCache that keeps every layer's states."""
    reference = DynamicCache()  # no config: sliding layers keep everything too; each plan's cache windows them
    prefill(model, full_ids[:, :width].to(model.device), full_mask[:, :width].to(model.device), reference)
    return reference


def replay(spec: str, model, reference: DynamicCache, document_mask: torch.Tensor):
    """A fresh cache for `spec` holding what a one-chunk prefill of the document would have left in it."""
    cache = make_cache(spec, model.config)
    positions = (document_mask.long().cumsum(-1) - 1).masked_fill(document_mask == 0, 1).to(model.device)
    for i, layer in enumerate(reference.layers):
        # `document_states` filled every layer of its DynamicCache, made without a config: DynamicLayers.
        assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
        cache.update(layer.keys, layer.values, i, kwargs={"position_ids": positions})
    return cache


def batch_groups(rows: Sequence[dict], encoded: Sequence[tuple[list[int], list[int]]]) -> list[str]:
    """Rows batch together only with the same task, answer cap and document length, so no row is padded: the
    int codecs' per-channel key groups (32 tokens) never span padding, which quantized a padded row in other
    groups than the row alone (and warned), and KVzip with an int codec stored it at other precision. A document
    length in tokens varies by a few with the needle, so batches are smaller; a plan's work is mostly per row."""
    return [f"{r['task']}|{r['max_new_tokens']}|{len(e[0])}" for r, e in zip(rows, encoded, strict=True)]


def rescores(spec: str) -> bool:
    """Whether the plan scores by reconstruction alone (KVzip): its cache keeps every state of the document until
    the reconstruction pass, so the shared prefill's states replayed into it, then that pass, leave what its own
    prefill would (tests/test_shared_prefill.py); only the pass, about one more prefill, runs per plan."""
    policy = parse_spec(spec)[0]
    return policy.scores_by_reconstruction and not policy.needs_attention


def replay_and_rescore(spec: str, model, reference: DynamicCache, ids: torch.Tensor, mask: torch.Tensor,
                       repeat_prompt_ids: list[int]):
    """`replay`, then KVzip's reconstruction pass over the document (`ids`, `mask`: [B, width]) as `prefill` runs it."""
    defaults = inspect.signature(prefill).parameters
    cache = replay(spec, model, reference, mask)
    score_by_reconstruction(model, ids.to(model.device), mask.to(model.device), cache, repeat_prompt_ids,
                             defaults["reconstruction_chunk"].default, defaults["reconstruction_overlap"].default,
                             None)
    return cache


@torch.inference_mode()
def run_plans(model, tokenizer, plans: Sequence[str], samples, *, batch_size: int = 1, model_name: str,
              prompt_format: PromptFormat = "auto", max_new_tokens: int | None = None, progress=None) -> list[dict]:
    """One record per (plan, sample), in the eval runner's record format, with one document prefill per batch.

    `max_new_tokens` caps every sample's answer (the tasks allow 16 tokens for a needle's 7 digits; every decoded
    token is a step of every plan). `progress(n)` is called with the samples done after each batch.
    """
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a whole number >= 1 or None (the task's own), got {max_new_tokens!r}")
    rows = [dict(r) for r in samples]
    if max_new_tokens is not None:
        for row in rows:
            row["max_new_tokens"] = min(row["max_new_tokens"], max_new_tokens)
    encoded = [encode(tokenizer, r, query_aware=False, prompt_format=prompt_format) for r in rows]
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = first_item(model.generation_config.eos_token_id)
    groups = batch_groups(rows, encoded)
    batches = plan_batches(["all"], encoded, [r["sample_id"] for r in rows], batch_size, None, groups=groups)
    eos = eos_ids(model)
    prompt_kind = "chat" if uses_chat(tokenizer, prompt_format) else "plain"
    repeat_ids = repeat_prompt_ids(tokenizer, chat=prompt_kind == "chat")
    served = getattr(torch, served_name(model))  # bytes are also counted at the dtype the model is served in
    records = []
    done = 0
    for item in batches:
        batch = [encoded[i] for i in item.rows]
        max_new = max(rows[i]["max_new_tokens"] for i in item.rows)
        full_ids, full_mask, width = left_pad(batch, pad_id)
        start = time.perf_counter()
        reference = document_states(model, full_ids, full_mask, width)
        shared_seconds = time.perf_counter() - start

        def answer(cache, full_ids=full_ids, full_mask=full_mask, max_new=max_new):
            """The cache's bytes after the document, then its answers (cut at the end of sequence) and the
            prefill seconds of the question."""
            kv = measured_kv_bytes(cache), tokens_per_layer(cache), served_kv_bytes(cache, served)
            result = generate(model, full_ids.to(model.device), full_mask.to(model.device), cache,
                              max_new_tokens=max_new)
            new = [row[: next((k for k, t in enumerate(row) if t in eos), len(row))]
                   for row in result.new_tokens.tolist()]
            return (*kv, new, result.prefill_seconds)

        for plan in plans:
            if rescores(plan):
                with AttentionSwitch(model, plan):
                    begin = time.perf_counter()
                    cache = replay_and_rescore(plan, model, reference, full_ids[:, :width], full_mask[:, :width],
                                               repeat_ids)
                    rescored = time.perf_counter() - begin
                    kv_document, stored, kv_served, new_tokens, seconds = answer(cache)
                prefill_seconds = shared_seconds + rescored + seconds
            elif needs_own_prefill(plan):
                out = run_batch(model, plan, batch, max_new, pad_token_id=pad_id, chunk_size=None,
                                repeat_prompt_ids=repeat_ids)
                new_tokens, kv_document, stored = out.new_tokens, out.kv_bytes_document, out.tokens_stored
                kv_served = out.kv_bytes_document_served
                prefill_seconds = out.prefill_seconds
            else:
                kv_document, stored, kv_served, new_tokens, seconds = answer(
                    replay(plan, model, reference, full_mask[:, :width]))
                prefill_seconds = shared_seconds + seconds
            predictions = [tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
            scores = score_all(predictions, [rows[i]["references"] for i in item.rows])
            share = len(item.rows)
            for k, i in enumerate(item.rows):
                row = rows[i]
                primary = scores[row["metric"]][k]
                records.append({
                    "method": plan, "sample_id": row["sample_id"], "task": row["task"], "length": row["length"],
                    "depth": row["depth"], "index": row["index"], "seed": row["seed"],
                    "split": row.get("split") or sample_split(row["index"]), "metric": row["metric"],
                    "score": primary, "correct": primary >= 100.0, "prediction": predictions[k],
                    "references": list(row["references"]), "protocol": protocol_name(False),
                    "prompt_format": prompt_kind, "document_tokens": len(encoded[i][0]),
                    "question_tokens": len(encoded[i][1]), "new_tokens": len(new_tokens[k]),
                    "tokens_kept": min(stored, len(encoded[i][0])),
                    "kv_bytes_document": kv_document / share, "kv_bytes_peak": kv_document / share,
                    "served_dtype": str(served).removeprefix("torch."), "kv_bytes_document_served": kv_served / share,
                    "kv_bytes_peak_served": kv_served / share,
                    "prefill_seconds": prefill_seconds / share, "decode_seconds": 0.0, "batch_rows": share,
                    "chunk_size": None, "model": model_name,
                    "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                })
        done += len(item.rows)
        if progress is not None:
            progress(done)
    return records
