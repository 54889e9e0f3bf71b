"""Run the evaluation samples through a model with each cache method, document first and question after.

For every batch a fresh cache receives the document part (in chunks when the method's memory is bounded, so it
compresses as it goes), its memory is measured, and only then is the question appended and the answer decoded
from the compressed cache. Results are appended to `results.jsonl` batch by batch, so an interrupted run resumes
where it stopped, reusing only records made with the same settings (`SETTING_FIELDS`); under
`accelerate launch --multi_gpu` or `torchrun` the batches are split between processes and gathered into the same
file a single process would write, each record naming its `process_index`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Collection, Sequence
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import __version__, registry
from ..budget import served_dtype
from ..generation import generate, prefill, repeat_prompt_ids, sync
from ..hf.attention import use_kvcompress_attention
from ..measure import measured_kv_bytes, served_kv_bytes
from . import report
from .prompts import PromptFormat, encode, protocol_name, uses_chat
from .resolved import resolved_digest
from .scoring import score_all
from .tasks import build_samples, check_split, sample_split

BASELINE = "dynamic"
RESULTS = "results.jsonl"
# What differs between two runs of the same samples (timings, clock, process layout), left out when comparing.
VOLATILE_FIELDS = ("prefill_seconds", "decode_seconds", "finished_at", "process_index")
# Everything besides (method, sample_id) that changes a result: a record is reused only when all of them match.
# `input_digest` hashes the sample's token ids and references, so task parameters, documents and tokenizer count.
# `resolved_digest` hashes what the method's spec resolves to on the model (eval/resolved.py), so a changed default
# or per-model setting counts without a version bump. A record written before it existed has none and is not
# reused: nothing in it shows which meaning its spec had (int4 on Gemma-3 changed rotation within one version).
SETTING_FIELDS = ("model", "dtype", "device", "protocol", "prompt_format", "chunk_size", "batch_size",
                  "max_new_tokens", "version", "input_digest", "resolved_digest")  # fmt: skip


# ------------------------------------------------------------------------------------------------ cache glue


def make_cache(spec: str, config):
    """A fresh cache for `spec` from the registry."""
    return registry.make_cache(spec, config)


def _bounds_memory(spec: str) -> bool:
    return registry.bounds_memory(spec)


def _needs_attention(spec: str) -> bool:
    check = getattr(registry, "needs_attention", None)
    return bool(check(spec)) if check is not None else False


def tokens_per_layer(cache) -> float:
    """Tokens a cache holds per layer (mean over layers), padding included."""
    counts = []
    for layer in getattr(cache, "layers", []):
        stored = getattr(layer, "stored_tokens", None)
        if stored is None:
            keys = getattr(layer, "keys", None)
            stored = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else None
        if stored is not None:
            counts.append(int(stored))
    return sum(counts) / len(counts) if counts else float("nan")


class AttentionSwitch:
    """Switch the model to the attention function that reports attention scores while a method needs it."""

    def __init__(self, model, spec: str):
        self.model, self.needed = model, _needs_attention(spec)
        self.previous = getattr(model.config, "_attn_implementation", None)

    def __enter__(self):
        if self.needed:
            use_kvcompress_attention(self.model)
        return self

    def __exit__(self, *exc):
        if self.needed and self.previous is not None:
            self.model.set_attn_implementation(self.previous)


# ------------------------------------------------------------------------------------------------ one batch


@dataclass
class BatchOutput:
    """What one batch produced: each row's new tokens (cut at EOS) and what the cache cost (whole batch)."""

    new_tokens: list[list[int]]
    kv_bytes_document: int
    kv_bytes_peak: int
    kv_bytes_document_served: int  # the same, counted at the served dtype (`served_torch_dtype`)
    kv_bytes_peak_served: int
    tokens_stored: float  # per layer, after the document
    prefill_seconds: float  # document and question
    decode_seconds: float


def left_pad(rows: Sequence[tuple[list[int], list[int]]], pad_token_id: int):
    """(document_ids, question_ids) rows as one left-padded batch: ids and mask [B, width + question], and width,
    the padded document length. Questions must have one length: padding between document and question would reach
    a cache after it has evicted."""
    question_lengths = {len(q) for _, q in rows}
    if len(question_lengths) != 1:
        raise ValueError(f"a batch needs questions of one length, got {sorted(question_lengths)}")
    width = max(len(d) for d, _ in rows)
    documents = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (document_ids, _) in enumerate(rows):
        documents[i, width - len(document_ids) :] = torch.tensor(document_ids)
        mask[i, width - len(document_ids) :] = 1
    questions = torch.tensor([q for _, q in rows], dtype=torch.long)
    return torch.cat([documents, questions], dim=1), torch.cat([mask, torch.ones_like(questions)], dim=1), width


def served_name(model) -> str:
    """The dtype the model is served in, whose bytes the reports compare: the dtype it runs in when that is 16-bit,
    else its config's 16-bit dtype, else bfloat16 (`budget.served_dtype`); a CPU runs it in float32."""
    return served_dtype(model.dtype, getattr(model.config, "dtype", None))[0]


def served_torch_dtype(model) -> torch.dtype:
    return getattr(torch, served_name(model))


class CompressedDocument:
    """The document parts of a batch's rows prefilled (and compressed) into one fresh cache, with what it cost.

    `answer` appends the questions to this cache (or to an untouched copy of it, `copy=True`, so the next
    question finds the document as compressed) and decodes. The document goes through `generation.prefill`, in
    chunks of `chunk_size` for methods with bounded memory (the others at once), which also runs KVzip's
    reconstruction pass (with `repeat_prompt_ids`) for the policies that score that way.
    """

    @torch.inference_mode()
    def __init__(self, model, spec: str, documents: Sequence[list[int]], *, pad_token_id: int,
                 chunk_size: int | None = 512, repeat_prompt_ids: list[int] | None = None):
        self.model, self.spec = model, spec
        ids, mask, self.width = left_pad([(d, []) for d in documents], pad_token_id)
        self.ids, self.mask = ids.to(model.device), mask.to(model.device)
        self.cache = make_cache(spec, model.config)
        self.step = chunk_size if chunk_size and _bounds_memory(spec) else max(self.width, 1)
        self.served = served_torch_dtype(model)
        self.peak = self.peak_served = 0  # the largest storage measured after any prefill chunk

        def measure_peak():
            self.peak = max(self.peak, measured_kv_bytes(self.cache))
            self.peak_served = max(self.peak_served, served_kv_bytes(self.cache, self.served))

        with AttentionSwitch(model, spec):
            sync(model.device)
            start = time.perf_counter()
            prefill(model, self.ids, self.mask, self.cache, chunk_size=self.step, repeat_prompt_ids=repeat_prompt_ids,
                    on_chunk=measure_peak)  # fmt: skip
            sync(model.device)
            self.seconds = time.perf_counter() - start
        self.kv_bytes = measured_kv_bytes(self.cache)
        self.kv_bytes_served = served_kv_bytes(self.cache, self.served)
        self.tokens_stored = tokens_per_layer(self.cache)

    @torch.inference_mode()
    def answer(self, questions: Sequence[list[int]], max_new_tokens: int, *, copy: bool = False,
               document_share: float = 1.0) -> BatchOutput:
        """Append one question per row (all of one length) and decode; `document_share` of the document's
        prefill seconds is charged to this answer."""
        if len({len(q) for q in questions}) != 1:
            raise ValueError(f"a batch needs questions of one length, got {sorted({len(q) for q in questions})}")
        if len(questions) != self.ids.shape[0]:
            raise ValueError(f"{len(questions)} questions for a document batch of {self.ids.shape[0]} rows")
        cache = deepcopy(self.cache) if copy else self.cache
        question_ids = torch.tensor(list(questions), dtype=torch.long, device=self.ids.device)
        full_ids = torch.cat([self.ids, question_ids], dim=1)
        full_mask = torch.cat([self.mask, torch.ones_like(question_ids)], dim=1)
        with AttentionSwitch(self.model, self.spec):
            result = generate(self.model, full_ids, full_mask, cache, max_new_tokens=max_new_tokens,
                              prefill_chunk_size=self.step)  # fmt: skip
        eos = eos_ids(self.model)
        new_tokens = []
        for row in result.new_tokens.tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            new_tokens.append(row[:cut])
        return BatchOutput(
            new_tokens=new_tokens,
            kv_bytes_document=self.kv_bytes,
            kv_bytes_peak=max(self.peak, result.kv_bytes),
            kv_bytes_document_served=self.kv_bytes_served,
            kv_bytes_peak_served=max(self.peak_served, self.kv_bytes_served, served_kv_bytes(cache, self.served)),
            tokens_stored=self.tokens_stored,
            prefill_seconds=self.seconds * document_share + result.prefill_seconds,
            decode_seconds=result.decode_seconds,
        )


def run_batch(
    model,
    spec: str,
    rows: Sequence[tuple[list[int], list[int]]],
    max_new_tokens: int,
    *,
    pad_token_id: int,
    chunk_size: int | None = 512,
    repeat_prompt_ids: list[int] | None = None,
) -> BatchOutput:
    """The protocol for a batch of (document_ids, question_ids): prefill and compress the document, then answer.

    Rows are left-padded; all rows must have question parts of the same length (padding between document and
    question would reach a cache after it has evicted). `chunk_size` applies to methods with bounded memory;
    the others prefill the document at once (`CompressedDocument`).
    """
    left_pad(rows, pad_token_id)  # questions of one length, checked before any work
    document = CompressedDocument(model, spec, [d for d, _ in rows], pad_token_id=pad_token_id, chunk_size=chunk_size,
                                  repeat_prompt_ids=repeat_prompt_ids)  # fmt: skip
    return document.answer([q for _, q in rows], max_new_tokens)


def eos_ids(model) -> set[int]:
    """The model's end-of-sequence token ids (its generation config may give one or several)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class WorkItem:
    """One batch: a method and the indices (into the samples) of the rows it runs.

    `shared_document`: the rows are questions about one document, which is prefilled once; each question is
    answered on an untouched copy of that compressed cache.
    """

    method: str
    rows: list[int]
    shared_document: bool = False


def shared_documents(encoded: Sequence[tuple[list[int], list[int]]], groups: Sequence[str]) -> list[list[int]]:
    """The rows that ask about the same document (one task, identical document tokens), for each such document
    with more than one question, in sample order."""
    by_document: dict[tuple, list[int]] = {}
    for i, (document_ids, _) in enumerate(encoded):
        by_document.setdefault((groups[i].split("|")[0], tuple(document_ids)), []).append(i)
    return [rows for rows in by_document.values() if len(rows) > 1]


def plan_batches(
    methods: Sequence[str],
    encoded: Sequence[tuple[list[int], list[int]]],
    sample_ids: Sequence[str],
    batch_size: int,
    chunk_size: int | None,
    done: Collection[tuple[str, str]] = frozenset(),
    groups: Sequence[str] | None = None,
) -> list[WorkItem]:
    """The batches of a run, the same whatever the number of processes.

    Rows of a batch share their group (the task: one answer length) and their question length, and their
    document lengths differ by less than one prefill chunk, so all padding reaches a cache in its first chunk,
    before anything is evicted. Every method runs the same batches, so their costs compare; pairs already in
    `done` are left out.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    spread = chunk_size or 512
    group = list(groups) if groups is not None else [""] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: (group[i], len(encoded[i][1]), -len(encoded[i][0]), i))
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if (
            last is not None
            and len(last) < batch_size
            and group[last[0]] == group[i]
            and len(encoded[last[0]][1]) == len(encoded[i][1])
            and len(encoded[last[0]][0]) - len(encoded[i][0]) < spread
        ):
            last.append(i)
        else:
            batches.append([i])
    items = []
    for method in methods:
        for batch in batches:
            rows = [i for i in batch if (method, sample_ids[i]) not in done]
            if rows:
                items.append(WorkItem(method, rows))
    return items


# ------------------------------------------------------------------------------------------------ results files


def read_results(out_dir: str | os.PathLike) -> list[dict]:
    """Every record in out_dir/results.jsonl and in unmerged per-process files (results.rank*.jsonl)."""
    out = Path(out_dir)
    records = []
    for path in [out / RESULTS, *sorted(out.glob("results.rank*.jsonl"))]:
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut short by an interrupted write: that sample runs again
    return records


def _ends_cleanly(path: Path) -> bool:
    """Whether `path` is empty or ends with a newline (not with a line an interrupted write cut short)."""
    if not path.exists() or path.stat().st_size == 0:
        return True
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def _append(path: Path, records: list[dict]) -> None:
    clean = _ends_cleanly(path)
    with open(path, "a", encoding="utf-8") as handle:
        if not clean:
            handle.write("\n")  # close the cut line, which readers skip, so the new records stay whole
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def export_samples(samples, out_dir: str | os.PathLike) -> list[Path]:
    """Write the samples to out_dir/data/<task>.jsonl, the files the lm-eval tasks read (metadata data_dir)."""
    folder = Path(out_dir) / "data"
    folder.mkdir(parents=True, exist_ok=True)
    by_task: dict[str, list[dict]] = {}
    for row in samples:
        by_task.setdefault(row["task"].split(":")[0].split("@")[0], []).append(dict(row))
    paths = []
    for task, rows in by_task.items():
        path = folder / f"{task}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ the run


def distributed_state():
    """accelerate's PartialState when launched with several processes, else None (no distributed set-up).

    `accelerate launch --multi_gpu` and `torchrun` start the processes and set WORLD_SIZE; without a GPU the
    processes join over gloo on the CPU (`cpu=True`), which accelerate does not choose by itself under torchrun.
    `accelerate launch --cpu` always starts a single process.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    from accelerate import PartialState  # the eval extra's; a single process never needs it

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE is {world} but accelerate set up {state.num_processes} process(es)")
    return state


def package_version() -> str:
    """The source's version: an editable install's metadata keeps the version it was installed at, and a stale
    version would let the runner reuse results made by other code."""
    return __version__


def input_digest(document_ids: Sequence[int], question_ids: Sequence[int], references: Sequence[str]) -> str:
    """A short hash of what a sample feeds the model and scores against."""
    text = json.dumps([list(document_ids), list(question_ids), list(references)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resume_key(record: dict) -> tuple:
    """What must match for a stored record to stand for a pair of this run: the pair and every setting."""
    return (record.get("method"), record.get("sample_id"), *(record.get(f) for f in SETTING_FIELDS))


def check_context(config, lengths: Sequence[int], max_new_tokens: int = 0) -> None:
    """Lengths (plus the answer) must fit the model's context (`config`'s), or positions past it give garbage."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(config, "max_position_embeddings", None)
    if context is None:
        return
    too_long = [n for n in lengths if n + max_new_tokens > context]
    if too_long:
        answer = f", and the prompt needs room for its {max_new_tokens} answer tokens" if max_new_tokens else ""
        raise ValueError(
            f"--lengths {','.join(map(str, too_long))}: the model's context is {context:,} tokens "
            f"(max_position_embeddings){answer}; use lengths <= {context - max_new_tokens:,}"
        )


def check_specs(methods: Sequence[str]) -> None:
    """Parse every cache spec before any work, so a typo fails at once with the registry's message."""
    for spec in methods:
        registry.parse_spec(spec)


def run_eval(
    model,
    tokenizer,
    methods: Sequence[str],
    tasks: Sequence[str] = ("needle",),
    lengths: Sequence[int] = (1000, 2000, 3000),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    out_dir: str | os.PathLike | None = None,
    *,
    samples=None,
    samples_per_cell: int = 1,
    seed: int = 0,
    split: str = "test",
    documents: str | None = None,
    query_aware: bool = False,
    prompt_format: PromptFormat = "auto",
    batch_size: int = 1,
    chunk_size: int | None = 512,
    limit: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
    write_reports: bool = True,
    baseline: bool = True,
    counts: dict | None = None,
) -> list[dict]:
    """Evaluate `methods` (cache specs) on the tasks' samples; returns one record per (method, sample).

    The uncompressed baseline `dynamic` is added in front when missing (`baseline=False` leaves it out; the
    summaries then have no baseline column values and flag nothing as too hard). With
    `out_dir`, records are appended to out_dir/results.jsonl as batches finish, (method, sample_id) pairs
    already there are skipped, and summary.md, summary.csv and the plots are written at the end (by the main
    process). `split` is the half of the samples (`test`, the default: what is reported; `dev`: what methods and
    defaults are tuned on; `all`: both; see tasks.sample_split), and every record names its sample's half.
    `samples` (a Dataset from `build_samples`) replaces tasks/lengths/depths/seed/split/documents/limit.
    Questions that share a document (multi_question) are answered from one prefill of it, each on an untouched
    copy of the compressed cache.
    Under `accelerate launch --multi_gpu` or `torchrun`, batches are split between processes and every process
    returns all records. Specs, sizes and the model's context are checked before any work; `counts`, when
    given, receives how many pairs were reused from out_dir and how many this run evaluates.
    """
    check_split(split)
    methods = list(dict.fromkeys([BASELINE, *methods] if baseline else methods))
    if not methods:
        raise ValueError("no methods to evaluate")
    check_specs(methods)
    if samples_per_cell < 1:
        raise ValueError(f"--samples must be at least 1 sample per (task, length, depth) cell, got {samples_per_cell}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1 sample per task, got {limit}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"--chunk-size must be a positive number of tokens, got {chunk_size}")
    if samples is None:
        check_context(model.config, lengths)
    state = distributed_state()
    is_main = state is None or state.is_main_process
    if samples is None:
        samples = build_samples(
            tokenizer, tasks, lengths, depths, samples_per_cell=samples_per_cell, seed=seed, split=split,
            documents=documents, prompt_format=prompt_format, limit=limit,
        )  # fmt: skip
    rows = [dict(row) for row in samples]
    if not rows:
        raise ValueError("no samples to evaluate (check --tasks, --lengths, --depths, --limit)")
    for row in rows:
        check_context(model.config, [max(row["length"], row.get("n_tokens", 0))], row["max_new_tokens"])
    sample_ids = [row["sample_id"] for row in rows]
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample ids must be unique")
    encoded = [encode(tokenizer, row, query_aware=query_aware, prompt_format=prompt_format) for row in rows]
    protocol = protocol_name(query_aware)
    chat = uses_chat(tokenizer, prompt_format)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = first_item(model.generation_config.eos_token_id)
    repeat_ids = repeat_prompt_ids(tokenizer, chat=chat)

    out = Path(out_dir) if out_dir is not None else None
    previous: list[dict] = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if state is None:
            _merge_shards(out)  # what an interrupted multi-process run left behind
        previous = read_results(out)
        if is_main:
            export_samples(samples, out)
    if state is not None:
        state.wait_for_everyone()  # every process plans from the same finished pairs before any writes more
    name = model_name or getattr(model.config, "_name_or_path", None) or type(model).__name__
    common = {
        "protocol": protocol,
        "prompt_format": "chat" if chat else "plain",
        "batch_size": batch_size,
        "model": name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": model.device.type,
        "version": package_version(),
    }

    digests = [input_digest(*encoded[i], row["references"]) for i, row in enumerate(rows)]
    resolved = {method: resolved_digest(method, model.config) for method in methods}

    def setting(method: str, i: int) -> dict:  # the values of SETTING_FIELDS for one (method, sample)
        return {**common, "chunk_size": chunk_size if _bounds_memory(method) else None,
                "max_new_tokens": rows[i]["max_new_tokens"], "input_digest": digests[i],
                "resolved_digest": resolved[method]}  # fmt: skip

    wanted = {resume_key({"method": m, "sample_id": sample_ids[i], **setting(m, i)}): (m, sample_ids[i])
              for m in methods for i in range(len(rows))}  # fmt: skip
    previous = [r for r in previous if resume_key(r) in wanted]
    done = {(r["method"], r["sample_id"]) for r in previous}
    groups = [f"{row['task']}|{row['max_new_tokens']}" for row in rows]
    shared = shared_documents(encoded, groups)
    # A shared document's questions run as one item per method (below), not in the padded batches.
    in_shared = {(m, sample_ids[i]) for m in methods for rows_of_document in shared for i in rows_of_document}
    plan = plan_batches(methods, encoded, sample_ids, batch_size, chunk_size, done | in_shared, groups)
    plan += [WorkItem(method, todo, shared_document=True) for method in methods for rows_of_document in shared
             if (todo := [i for i in rows_of_document if (method, sample_ids[i]) not in done])]  # fmt: skip
    mine = plan
    if state is not None:
        with state.split_between_processes(plan) as share:
            mine = list(share)
    process_index = state.process_index if state is not None else 0
    shard = None
    if out is not None:
        shard = out / (RESULTS if state is None else f"results.rank{process_index}.jsonl")
    if counts is not None:
        counts.update(reused=len(done), to_run=sum(len(item.rows) for item in plan))

    bar = None
    if progress and is_main:
        if not plan:
            where = "" if out is None else f" in {out / RESULTS}"  # without an output folder: no samples
            print(f"eval: all {len(done)} results are already{where} (same settings); nothing to run",
                  file=sys.stderr)  # fmt: skip
        else:
            where = f" [process 0 of {state.num_processes}: its share]" if state is not None else ""
            earlier = f", {len(done)} done before" if done else ""
            bar = tqdm(total=sum(len(item.rows) for item in mine), desc=f"eval{where}{earlier}", unit=" samples",
                       dynamic_ncols=True)  # fmt: skip
    new_records: list[dict] = []
    try:  # the bar closes before an error or Ctrl-C message is printed, not after it
        for item in mine:
            if item.shared_document:  # one prefill of the document; each question on its own copy of the cache
                document = CompressedDocument(model, item.method, [encoded[item.rows[0]][0]], pad_token_id=pad_id,
                                              chunk_size=chunk_size, repeat_prompt_ids=repeat_ids)  # fmt: skip
                answers = [(document.answer([encoded[i][1]], rows[i]["max_new_tokens"], copy=True,
                                            document_share=1 / len(item.rows)), 0, 1) for i in item.rows]  # fmt: skip
            else:
                batch = [encoded[i] for i in item.rows]
                max_new = max(rows[i]["max_new_tokens"] for i in item.rows)
                output = run_batch(model, item.method, batch, max_new, pad_token_id=pad_id, chunk_size=chunk_size,
                                   repeat_prompt_ids=repeat_ids)  # fmt: skip
                answers = [(output, k, len(item.rows)) for k in range(len(item.rows))]
            predictions = [tokenizer.decode(out.new_tokens[k], skip_special_tokens=True) for out, k, _ in answers]
            scores = score_all(predictions, [rows[i]["references"] for i in item.rows])
            records = []
            for k, i in enumerate(item.rows):
                row = rows[i]
                output, row_in_batch, share = answers[k]
                document_ids, question_ids = encoded[i]
                primary = scores[row["metric"]][k]
                records.append({
                    "method": item.method,
                    "sample_id": row["sample_id"],
                    "task": row["task"],
                    "length": row["length"],
                    "depth": row["depth"],
                    "index": row["index"],
                    "seed": row["seed"],
                    "split": row.get("split") or sample_split(row["index"]),
                    "metric": row["metric"],
                    "score": primary,
                    "correct": primary >= 100.0,
                    **{name: values[k] for name, values in scores.items()},
                    "prediction": predictions[k],
                    "references": list(row["references"]),
                    "document_tokens": len(document_ids),
                    "question_tokens": len(question_ids),
                    "prompt_tokens": len(document_ids) + len(question_ids),
                    "new_tokens": len(output.new_tokens[row_in_batch]),
                    "tokens_kept": min(output.tokens_stored, len(document_ids)),
                    # The cache serves the whole batch; each row is charged an equal share of it. Questions about
                    # one document are each served by a copy of its whole compressed cache.
                    "kv_bytes_document": output.kv_bytes_document / share,
                    "kv_bytes_peak": output.kv_bytes_peak / share,
                    "served_dtype": served_name(model),
                    "kv_bytes_document_served": output.kv_bytes_document_served / share,
                    "kv_bytes_peak_served": output.kv_bytes_peak_served / share,
                    "prefill_seconds": output.prefill_seconds / share,
                    "decode_seconds": output.decode_seconds / share,
                    "batch_rows": share,
                    "document_questions": len(item.rows) if item.shared_document else 1,
                    **setting(item.method, i),
                    "process_index": process_index,
                    "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                })  # fmt: skip
            if shard is not None:
                _append(shard, records)
            new_records.extend(records)
            if bar is not None:
                bar.update(len(records))
    finally:
        if bar is not None:
            bar.close()

    if state is not None:
        from accelerate.utils import gather_object  # the eval extra's, as in distributed_state

        state.wait_for_everyone()
        gathered = gather_object(new_records)
        if is_main and out is not None:
            _merge_shards(out)
        state.wait_for_everyone()
        new_records = gathered

    by_key = {(r["method"], r["sample_id"]): r for r in previous}
    by_key.update({(r["method"], r["sample_id"]): r for r in new_records})
    records = [by_key[(m, s)] for m in methods for s in sample_ids if (m, s) in by_key]
    if out is not None and write_reports and is_main:
        # The reports cover the folder, not this run alone: methods of earlier runs stay in summary.md when
        # their records match this run's samples and settings (what a rerun of them would reuse).
        folder, stored, left_out = read_results(out), [], []
        for method in dict.fromkeys(r.get("method") for r in folder):
            if method in methods or not isinstance(method, str):
                continue
            try:
                resolved[method] = resolved_digest(method, model.config)
            except (ValueError, KeyError, FileNotFoundError):  # a spec this version no longer builds
                left_out.append(method)
                continue
            keys = {resume_key({"method": method, "sample_id": sample_ids[i], **setting(method, i)})
                    for i in range(len(rows))}  # fmt: skip
            found = {r["sample_id"]: r for r in folder if resume_key(r) in keys}  # the latest record wins
            stored += [found[s] for s in sample_ids if s in found]
            if not found:
                left_out.append(method)
        notes = [f"Also in {RESULTS}, made with other settings or samples than this run's and not summarized: "
                 + ", ".join(f"`{m}`" for m in left_out) + "."] if left_out else []  # fmt: skip
        report.write_reports(records + stored, out, notes=notes)
    return records


def _merge_shards(out: Path) -> None:
    """Append the per-process files to results.jsonl in rank order and delete them.

    Each process ran a contiguous slice of the plan in order, so rank order is the order one process would have
    written; records an interrupted earlier run left in a process's file come first in it and are kept too.
    """
    shards = sorted(out.glob("results.rank*.jsonl"), key=lambda p: int(p.name.split(".")[1].removeprefix("rank")))
    if not shards:
        return
    clean = _ends_cleanly(out / RESULTS)
    with open(out / RESULTS, "a", encoding="utf-8") as target:
        if not clean:
            target.write("\n")
        for shard in shards:
            with open(shard, encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        target.write(line if line.endswith("\n") else line + "\n")
        target.flush()
        os.fsync(target.fileno())
    for shard in shards:
        shard.unlink()


def first_item(value):
    """`value`'s first element when it is a list or tuple (a config's several EOS ids), else `value`."""
    return value[0] if isinstance(value, (list, tuple)) else value
