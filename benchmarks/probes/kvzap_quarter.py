"""Why does kvzap lose at a quarter what kvzip keeps: its recent window, its probe, or how its pairs are shared?

Question: on the eval's own path (`CompressedDocument`: the document prefilled and compressed, then the question
appended and answered), which answers do `kvzip` and `kvzap` keep at one ratio, and what changes when kvzap ranks by
KVzip's own scores instead of its probe's (an oracle probe: for the document's tokens it returns the log of the score
KVzip's reconstruction pass gives them, so everything else, the plan, sliding share, recent window and head ranking,
is kvzap's)? Also prints how many pairs each full-attention layer keeps, per variant, and the share of KVzip's kept
pairs each variant keeps.
Command:
    python benchmarks/probes/kvzap_quarter.py [--model gemma-3-270m] [--ratio 0.25] [--split dev]
        [--tasks needle multi_question] [--lengths 2000] [--depths 10 50 90] [--samples 2]
        [--variants kvzip kvzap kvzap-oracle ...] [--probe FILE]
Written up: docs/results.md, "KVzap at a quarter".

A measurement to decide what to build, not a cache. A variant is a spec, optionally with the oracle probe (name
ending in "-oracle"); see VARIANTS.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids
from hf_kvcompress.eval import runner
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.scoring import score_all
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.probe_calibration import full_attention_layers

# name -> (spec with {r} for the ratio, oracle probe)
VARIANTS = {
    "kvzip": ("kvzip:ratio={r}", False),
    "kvzip-recent128": ("kvzip:ratio={r},recent=128", False),
    "kvzap": ("kvzap:ratio={r}", False),
    "kvzap-recent0": ("kvzap:ratio={r},recent=0", False),
    "kvzap-oracle": ("kvzap:ratio={r}", True),
    "kvzap-recent0-oracle": ("kvzap:ratio={r},recent=0", True),
    "kvzap-span8": ("kvzap:ratio={r},span=8", False),
    "kvzap-span16": ("kvzap:ratio={r},span=16", False),
}


class OracleProbe(torch.nn.Module):
    """Returns, for the next `n` tokens it is asked about, the log of KVzip's score of the document's tokens
    ([H, T] `scores`), and 0 past the document (later tokens rank above it anyway: head_ranking.py)."""

    def __init__(self, scores: torch.Tensor):
        super().__init__()
        self.scores = scores.clamp(min=1e-12).log()
        self.seen = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, new, _ = hidden.shape
        heads, length = self.scores.shape
        out = torch.zeros(batch, heads, new)
        have = max(0, min(new, length - self.seen))
        out[:, :, :have] = self.scores[:, self.seen : self.seen + have]
        self.seen += new
        return out


@torch.inference_mode()
def kvzip_scores(model, ids, prompt, layers) -> dict[int, torch.Tensor]:
    """KVzip's reconstruction scores [H, T] of each full-attention layer, nothing evicted."""
    cache = make_cache("kvzip:ratio=1.0,budgets=uniform,span=0", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=prompt)
    return {i: cache.layers[i].slots.accumulated[0, :, : ids.shape[1]].float().clone() for i in layers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--probe", default=None, help="kvzap's probe file (default: the one shipped for the model)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    model, tok = load_model(args.model)
    layers = full_attention_layers(model.config)
    prompt = repeat_prompt_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = [dict(r) for r in build_samples(tok, args.tasks, args.lengths, args.depths,
                                           samples_per_cell=args.samples, seed=0, split=args.split)]
    oracle: dict[int, torch.Tensor] = {}
    real_make_cache = runner.make_cache

    def make_with_oracle(spec, config):
        cache = real_make_cache(spec, config)
        for i, scores in oracle.items():
            cache.layers[i].scorer.probe = OracleProbe(scores)
        return cache

    kept = defaultdict(int)
    counts = defaultdict(list)  # variant -> per-document pairs per full-attention layer
    answered = 0
    documents: dict[tuple, tuple] = {}
    for n, row in enumerate(rows):
        doc, question = encode(tok, row)
        key = tuple(doc)
        if key not in documents:
            documents.clear()
            needs_truth = any(VARIANTS[name][1] for name in args.variants)
            truth = kvzip_scores(model, torch.tensor([doc]), prompt, layers) if needs_truth else {}
            compressed = {}
            for name in ["dynamic", *args.variants]:
                spec, use_oracle = VARIANTS.get(name, ("dynamic", False))
                spec = spec.format(r=args.ratio)
                if args.probe is not None and spec.startswith("kvzap"):
                    spec = spec.replace(":", f":probe={args.probe},", 1)
                oracle.clear()
                if use_oracle:
                    oracle.update(truth)
                runner.make_cache = make_with_oracle
                try:
                    compressed[name] = runner.CompressedDocument(model, spec, [doc], pad_token_id=pad,
                                                                 repeat_prompt_ids=prompt)
                finally:
                    runner.make_cache = real_make_cache
                if name != "dynamic":
                    counts[name].append([compressed[name].cache.layers[i].stored_tokens for i in layers])
            documents[key] = compressed
        compressed = documents[key]
        line = []
        results = {}
        for name, document in compressed.items():
            out = document.answer([question], row["max_new_tokens"], copy=True)
            text = tok.decode(out.new_tokens[0], skip_special_tokens=True)
            results[name] = score_all([text], [row["references"]])[row["metric"]][0] >= 100.0
        if not results["dynamic"]:
            print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: dynamic misses", flush=True)
            continue
        answered += 1
        for name in args.variants:
            kept[name] += results[name]
            line.append(f"{name}={int(results[name])}")
        print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: " + " ".join(line), flush=True)
    print(f"\n{args.model} {args.tasks} {args.split} half, lengths {args.lengths}, ratio {args.ratio}: "
          f"answers kept of the {answered} dynamic answers")
    for name in args.variants:
        per_layer = torch.tensor(counts[name], dtype=torch.float).mean(0).tolist()
        shown = ", ".join(f"L{i} {c:.0f}" for i, c in zip(layers, per_layer, strict=True))
        print(f"{name:>22}: {kept[name]} / {answered}   pairs per KV head kept after the document: {shown}")


if __name__ == "__main__":
    main()
