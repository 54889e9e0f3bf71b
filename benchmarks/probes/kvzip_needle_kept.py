"""What a real KVzip cache keeps of each needle sentence (the asked one and the distractors), and whether it answers.

Question: on multi_needle prompts (several "The special magic number for {key} is: {value}." sentences, one asked),
which of each sentence's tokens does `kvzip:ratio=R` keep, as a share of every (layer, KV head) pair, beside the
document's average, and does the cache still answer where the uncompressed one does?
Command:
    python benchmarks/probes/kvzip_needle_kept.py [--model smollm2-135m] [--ratio 0.5] [--task multi_needle]
        [--split dev] [--depths 10 50 90] [--samples 2]
Written up: docs/results.md, "KVzip on SmolLM2's multi_needle test half: distractor needles".

Each prompt is answered by `dynamic` and by the plain spec (prefill with KVzip's pass, then `generate`, as the eval
does); the head budgets' keep masks are read as the cache computes them (`head_budget_keep`, wrapped, returns
them unchanged). Printed per needle sentence: each token with the share of (layer, head) pairs that keep it, and the
mean share per decoder layer. Only for specs with KVzip's head budgets (the default `budgets=head`).
"""

from __future__ import annotations

import argparse

import torch

import hf_kvcompress.caches.compressed as compressed
from hf_kvcompress import load_model, make_cache
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, prefill, repeat_prompt_ids

SENTENCE = " special magic number for"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", default="0.5")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    model, tok = load_model(args.model)
    captured: list[torch.Tensor] = []
    ranking = compressed.head_budget_keep

    def recording(*positional, **named):
        out = ranking(*positional, **named)
        captured.append(torch.stack([keep[0].float() for _, keep in out]))  # [layers, heads, T] of row 0
        return out

    compressed.head_budget_keep = recording  # the cache's own call: the module's name is looked up at call time
    repeat = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, [args.task], [2000], args.depths, samples_per_cell=args.samples,
                                           split=args.split)]  # fmt: skip
    pattern = tok(SENTENCE, add_special_tokens=False).input_ids
    spec = f"kvzip:ratio={args.ratio}"
    for row in rows:
        doc, question = encode(tok, row)
        reference = row["references"][0]
        for method in ("dynamic", spec):
            cache = make_cache(method, model.config)
            if method != "dynamic":
                prefill(model, torch.tensor([doc]), None, cache, repeat_prompt_ids=repeat)
            result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=row["max_new_tokens"])
            text = tok.decode(result.new_tokens[0], skip_special_tokens=True)
            print(f"{row['sample_id']} {method}: correct={reference in text} {text!r} (reference {reference})")
        kept = captured[-1]
        share = kept.mean((0, 1))
        print(f"  {row['question'][:90]}  document's mean kept share {share.mean():.2f}")
        for i in range(len(doc) - len(pattern)):
            if doc[i : i + len(pattern)] == pattern:
                span = range(max(0, i - 2), min(len(doc), i + 22))
                print("    " + " ".join(f"{tok.decode([doc[j]])!r}:{share[j]:.2f}" for j in span))
                per_layer = kept[:, :, span.start : span.stop].mean((1, 2))
                print("      per layer: " + " ".join(f"{v:.1f}" for v in per_layer.tolist()), flush=True)


if __name__ == "__main__":
    main()
