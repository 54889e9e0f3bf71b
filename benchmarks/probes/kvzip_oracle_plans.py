"""Would a ranking that knew the question keep what KVzip loses, with the same plan (layout, codec, bytes)? (issue 27)

Question: on a plain KVzip spec (`kvzip:ratio=0.5`, `0.25`, `0.125`, `0.25+int4`, `bytes=B`: on a hybrid model the
byte plans, the sliding layers' newest tokens, int4), when the cache loses an answer the uncompressed cache gives,
does it keep it when the full-attention layers rank the *oracle's* scores (the most attention each pair receives
from the question and the right answer's tokens) instead of KVzip's reconstruction scores, everything else equal?
Command:
    PYTHONPATH=. python benchmarks/probes/kvzip_oracle_plans.py --model gemma-3-270m --task multi_needle \\
        --length 2000 --depths 10 50 90 --samples 4 --split dev \\
        --specs kvzip:ratio=0.5 kvzip:ratio=0.25 kvzip:ratio=0.125 kvzip:ratio=0.25+int4 \\
        [--sources pass ours oracle] [--only SAMPLE_ID ...] [--out results/kvzip-oracle-plans]
Written up: docs/results.md, "Gemma-3's missed cells under a question-aware oracle ranking (issue 27, session 36;
helper i27o)".

Each document is compressed as `hf-kvcompress eval` compresses it (`runner.CompressedDocument`: the eval's prefill
chunks, the spec's own plan, codec and byte target) and each question answered on an untouched copy, with the eval's
metric. Sources of the scores the cache ranks at the pass's end:
- `pass`: KVzip's own reconstruction pass, unchanged (the eval's path); its scores are saved.
- `ours`: the pass is skipped and the scores `pass` left are put in the scored layers' place before the cache ranks
  (the same ranking, eviction and decoding as after the pass): it must answer as `pass` does, or the injection
  changes something besides the scores and the oracle's row means nothing.
- `oracle`: the pass is skipped and the oracle's scores (one per question: the question as the pass's prompt, the
  reference answer as the text it reads, every document pair's most attention from those queries) are put there.
  Only the layers KVzip scores receive them (a hybrid model's full-attention layers); the sliding layers keep their
  newest tokens by plan, as with KVzip's scores. The spec's `span` and byte accounting apply to them unchanged.
Printed per question and source: right or not, the answer, and the cache's bytes after the document over the
uncompressed cache's (both counted in the served dtype, as retention_table.py reads the eval's records).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import hf_kvcompress.generation as generation
from hf_kvcompress import load_model
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.runner import CompressedDocument
from hf_kvcompress.eval.scoring import score_all
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import repeat_prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvzip_multi_needle_scores import oracle_scores  # noqa: E402  # the oracle's [L, H, T] scores

SOURCES = ("pass", "ours", "oracle")


def scored_layers(cache) -> list:
    """The layers whose pairs the cache ranks by reconstruction scores (a hybrid model's full-attention layers)."""
    return [layer for layer in cache.layers if layer.policy.scores_by_reconstruction and layer.is_initialized]


def compress(model, spec: str, doc: list[int], repeat, scores: torch.Tensor | None):
    """(CompressedDocument, [L, H, T] scores the scored layers ranked by). `scores` None: KVzip's own pass, whose
    scores are read at its end; otherwise the pass is skipped and `scores` ranked in its place."""
    captured: list[torch.Tensor] = []
    end = CompressedCache.end_reconstruction

    def reading(cache, evict: bool = True):
        layers = scored_layers(cache)
        if evict and scores is not None:
            if scores.shape[0] != len(layers):
                raise ValueError(f"{scores.shape[0]} layers of scores for {len(layers)} scored layers")
            for layer, given in zip(layers, scores, strict=True):
                if given.shape != layer.slots.accumulated[0].shape:
                    raise ValueError(f"scores {tuple(given.shape)} for a layer holding "
                                     f"{tuple(layer.slots.accumulated[0].shape)}")
                layer.slots.accumulated = given[None].to(layer.slots.accumulated)
        if evict:
            captured.extend(layer.slots.accumulated[0].clone() for layer in layers)
        return end(cache, evict)

    original = generation.score_by_reconstruction

    def skipped(model, input_ids, attention_mask, cache, *rest):  # the pass's bracket without its forward passes
        cache.begin_reconstruction()
        cache.end_reconstruction(evict=True)

    CompressedCache.end_reconstruction = reading  # type: ignore[method-assign]
    if scores is not None:
        generation.score_by_reconstruction = skipped
    try:
        document = CompressedDocument(model, spec, [doc], pad_token_id=0, repeat_prompt_ids=repeat)
    finally:
        CompressedCache.end_reconstruction = end  # type: ignore[method-assign]
        generation.score_by_reconstruction = original
    return document, (torch.stack(captured) if captured else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--split", default="dev", choices=("dev", "test", "all"))
    parser.add_argument("--specs", nargs="+", default=["kvzip:ratio=0.5", "kvzip:ratio=0.25", "kvzip:ratio=0.125",
                                                       "kvzip:ratio=0.25+int4"])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    parser.add_argument("--only", nargs="*", default=[], help="sample ids to run (default: every sample)")
    parser.add_argument("--out", default="results/kvzip-oracle-plans", help="saved scores and results.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(args.model)
    repeat = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, [args.task], [args.length], args.depths,
                                           samples_per_cell=args.samples, split=args.split)]  # fmt: skip
    rows = [r for r in rows if not args.only or r["sample_id"] in args.only]
    documents: dict[tuple[int, ...], list[tuple[dict, list[int]]]] = defaultdict(list)
    for row in rows:
        doc, question = encode(tok, row)
        documents[tuple(doc)].append((row, question))
    tally: dict[str, list[bool]] = defaultdict(list)
    results = out / "results.jsonl"

    def record(row, label: str, text: str, share: float | None) -> bool:
        right = score_all([text], [row["references"]])[row["metric"]][0] >= 100.0  # the eval's metric
        tally[label].append(right)
        bytes_text = "" if share is None else f" at {share:.3f}"
        print(f"  {row['sample_id']} {label}: {right} {text!r}{bytes_text}", flush=True)
        with results.open("a") as f:
            f.write(json.dumps({"sample_id": row["sample_id"], "depth": row["depth"], "variant": label,
                                "correct": right, "prediction": text, "bytes": share}) + "\n")  # fmt: skip
        return right

    def answer(document, row, question) -> str:
        result = document.answer([question], row["max_new_tokens"], copy=True)
        return tok.decode(result.new_tokens[0], skip_special_tokens=True)

    for doc_ids, asked in documents.items():
        doc = list(doc_ids)
        digest = hashlib.sha1(str(doc).encode()).hexdigest()[:12]
        print(f"\ndocument {digest}: {len(doc)} tokens, {len(asked)} question(s)", flush=True)
        dynamic, _ = compress(model, "dynamic", doc, repeat, None)
        base = dynamic.kv_bytes_served
        answered = [(row, q) for row, q in asked if record(row, "dynamic", answer(dynamic, row, q), None)]
        del dynamic
        if not answered:
            continue  # retention counts the answers the uncompressed cache gives
        oracles = {}
        if "oracle" in args.sources:
            for row, question in answered:
                path = out / f"{args.model}-oracle-{digest}-{row['sample_id'].replace('/', '_')}.pt"
                if not path.exists():
                    reply = tok(" " + row["references"][0], add_special_tokens=False).input_ids
                    torch.save(oracle_scores(model, doc, question, reply), path)
                oracles[row["sample_id"]] = torch.load(path)
        for spec in args.specs:
            saved = out / f"{args.model}-{spec.replace(':', '_').replace('+', '_')}-{digest}.pt"
            if "pass" in args.sources or ("ours" in args.sources and not saved.exists()):
                document, ours = compress(model, spec, doc, repeat, None)
                torch.save(ours, saved)
                share = document.kv_bytes_served / base
                for row, question in answered:
                    record(row, f"{spec} pass", answer(document, row, question), share)
                del document
            if "ours" in args.sources:
                document, _ = compress(model, spec, doc, repeat, torch.load(saved))
                share = document.kv_bytes_served / base
                for row, question in answered:
                    record(row, f"{spec} ours", answer(document, row, question), share)
                del document
            for row, question in answered if "oracle" in args.sources else []:
                document, _ = compress(model, spec, doc, repeat, oracles[row["sample_id"]])
                record(row, f"{spec} oracle", answer(document, row, question), document.kv_bytes_served / base)
                del document
    print("\nanswered:", "; ".join(f"{k} {sum(v)}/{len(v)}" for k, v in tally.items()))


if __name__ == "__main__":
    main()
