"""Where a KVzip cache's ranking puts each asked answer's tokens: kept or not, and how many pairs would keep them.

Question: when a KVzip cache loses an answer on a long document (Gemma-3's eighth at 8,000 tokens), were the
answer's own tokens evicted by the ranking, and would the full-attention layers have kept them with more pairs
(a count the bytes could buy) or only with nearly all of them (the scores do not value them)?
Command:
    python benchmarks/probes/kvzip_answer_rank.py [--model gemma-3-270m] [--spec kvzip:ratio=0.125]
        [--tasks needle multi_question] [--length 8000] [--depths 10] [--split dev] [--samples 1]
Written up: docs/results.md, "Gemma-3's eighth at 8,000 tokens: what it loses and why (issue 27, session 35;
helper i27e)".

Each document is compressed as the eval compresses it (`runner.CompressedDocument`: the same chunks and KVzip
pass) and each of its questions answered on an untouched copy. The ranking's per-layer (priority, keep) are read as
the cache computes them (`head_budget_keep`, wrapped, returns them unchanged). For each answer occurrence in the
document (the reference's characters, mapped to tokens), per ranked (full-attention) layer: the share of its tokens
kept, and the share of the ranked pairs (all ranked layers and heads together) that rank at or above its
lowest-ranked token, i.e. how large a share of the ranked pairs a count-based ranking must keep to keep every one
of its tokens ("needs"), and the share of that layer's own pairs that do ("of its own": what a per-layer floor
would have to give it). "kept share" is the share of the ranked pairs the cache kept, in all and per layer
(L0, L1, ...: the ranked layers in order).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import hf_kvcompress.caches.compressed as compressed
from hf_kvcompress import load_model
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.runner import CompressedDocument
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import repeat_prompt_ids


def token_spans(tok, ids: list[int], text: str) -> list[range]:
    """Token ranges of `ids` whose decoded characters hold `text` (every occurrence, at most 3)."""
    ends, so_far = [], ""
    for i in range(len(ids)):
        so_far += tok.decode([ids[i]])
        ends.append(len(so_far))
    spans, start = [], so_far.find(text)
    while start >= 0 and len(spans) < 3:
        stop = start + len(text)
        first = next(i for i, e in enumerate(ends) if e > start)
        last = next(i for i, e in enumerate(ends) if e >= stop)
        spans.append(range(first, last + 1))
        start = so_far.find(text, stop)
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--spec", default="kvzip:ratio=0.125")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--depths", type=float, nargs="+", default=[10])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--samples", type=int, default=1)
    args = parser.parse_args()
    model, tok = load_model(args.model)
    captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    ranking = compressed.head_budget_keep

    def recording(*positional, **named):
        out = ranking(*positional, **named)
        captured.append([(priority[0].float(), keep[0]) for priority, keep in out])  # row 0: [H, T] each
        return out

    compressed.head_budget_keep = recording  # the cache's own call: the module's name is looked up at call time
    repeat = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, [args.length], args.depths,
                                           samples_per_cell=args.samples, split=args.split)]  # fmt: skip
    documents: dict[tuple[int, ...], list[tuple[dict, list[int]]]] = defaultdict(list)
    for row in rows:
        doc, question = encode(tok, row)
        documents[tuple(doc)].append((row, question))
    for doc_ids, asked in documents.items():
        doc = list(doc_ids)
        captured.clear()
        document = CompressedDocument(model, args.spec, [doc], pad_token_id=tok.pad_token_id or 0,
                                      repeat_prompt_ids=repeat)  # fmt: skip
        layers = captured[-1] if captured else []
        # Every ranked pair's priority, the protected (sinks) at +inf and padding at -inf left out of the shares.
        flat = torch.cat([p.flatten() for p, _ in layers]) if layers else torch.zeros(0)
        real = flat[flat > float("-inf")]
        kept_share = sum(int(k.sum()) for _, k in layers) / max(real.numel(), 1)
        per_layer = ", ".join(f"L{i} {float(k.float().mean()):.3f}" for i, (_, k) in enumerate(layers))
        print(f"{asked[0][0]['sample_id'].rsplit('/', 2)[0]}: {len(doc)} tokens, {len(layers)} ranked layers, "
              f"kept share {kept_share:.3f} (of each layer's pairs: {per_layer})", flush=True)
        for row, question in asked:
            out = document.answer([question], row["max_new_tokens"], copy=True)
            text = tok.decode(out.new_tokens[0], skip_special_tokens=True)
            reference = row["references"][0]
            print(f"  {row['sample_id']}: correct={reference in text} {text!r} (reference {reference!r})")
            for span in token_spans(tok, doc, reference):
                parts = []
                for index, (priority, keep) in enumerate(layers):
                    scores = priority[:, span.start : span.stop]  # [H, tokens]
                    lowest = float(scores.min())
                    needs = float((real >= lowest).float().mean())
                    own = priority[priority > float("-inf")]
                    within = float((own >= lowest).float().mean())
                    parts.append(f"L{index}: kept {float(keep[:, span.start:span.stop].float().mean()):.2f}, "
                                 f"needs {needs:.3f} ({within:.3f} of its own)")  # fmt: skip
                where = span.start / len(doc)
                print(f"    tokens {span.start}-{span.stop - 1} ({where:.2f} of the document): " + "; ".join(parts),
                      flush=True)


if __name__ == "__main__":
    main()
