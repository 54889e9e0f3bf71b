"""Which fails kvzap, its probe's scores or how the kept pairs are shared out?

Question: with the same number of kept pairs, how many answers do KVzip's own scores and the KVzap probe's
estimates keep, each with one share per KV head (`budgets=uniform`) and with one ranking of every layer's and
head's pairs (`budgets=head`)? And how much of KVzip's kept set does the probe's keep?
Command:
    python benchmarks/probes/kvzap_allocation.py [--model smollm2-135m] [--tasks needle multi_question]
        [--lengths 2000] [--depths 10 50 90] [--samples 2] [--ratios 0.5] [--split dev]
Written up: docs/results.md, "KVzap" (head budgets).

A measurement to decide what to build, not a cache: each document is prefilled once with
`kvzip:ratio=1.0,budgets=uniform,span=0` (its reconstruction pass scores every pair, nothing is evicted) while the
hidden state entering each full-attention layer is recorded; the shipped probe turns those into its estimates. Each
allocation keeps the same number of pairs (the ratio's share per head, the newest `--recent` protected as kvzap's
window, each pair chosen by its score pooled over the next `--span`, as both policies choose) and is applied as a
per-head attention mask over the document while the question is read and answered (benchmarks/probes/
kvzip_budget_allocation.py's masks). Prints per sample which allocations answer, the totals over the samples the
uncompressed cache answers, and the probe's recall of KVzip's kept pairs (per head, and of the joint ranking).
"""

from __future__ import annotations

import argparse
import copy
import math
import os

import kvzip_budget_allocation as kba
import torch

from hf_kvcompress import make_cache, prefill, repeat_prompt_ids
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate
from hf_kvcompress.hf.hidden_states import attention_modules
from hf_kvcompress.policies.kvzip import best_ahead
from hf_kvcompress.probe_calibration import full_attention_layers
from hf_kvcompress.probes import estimated_score, load_probes


def allocate(scores: dict[int, torch.Tensor], ratio: float, how: str, recent: int,
             span: int) -> dict[int, torch.Tensor]:
    """Kept-pair masks [1, H, T] per layer from scores [H, T] comparable across heads and layers."""
    length, heads = next(iter(scores.values())).shape[-1], next(iter(scores.values())).shape[0]
    protected = torch.zeros(length, dtype=torch.bool)
    protected[length - recent :] = True
    per_head = math.ceil(length * ratio)
    scores = {i: s.masked_fill(protected, float("inf")) for i, s in scores.items()}
    if how == "uniform":
        counts = {i: torch.full((heads,), per_head) for i in scores}
    elif how == "head":
        threshold = torch.cat([s.flatten() for s in scores.values()]).topk(per_head * heads * len(scores)).values[-1]
        counts = {i: (s >= threshold).sum(-1) for i, s in scores.items()}
    else:
        raise ValueError(f"allocation must be uniform or head, got {how!r}")
    masks = {}
    for i, s in scores.items():
        order = best_ahead(s[None], span)[0].argsort(-1, descending=True)
        mask = torch.zeros(1, heads, length, dtype=torch.bool)
        for h in range(heads):
            mask[0, h, order[h, : int(counts[i][h])]] = True
        masks[i] = mask
    return masks


def recall(estimate: dict[int, torch.Tensor], truth: dict[int, torch.Tensor], ratio: float) -> tuple[float, float]:
    """(per-head recall of KVzip's best `ratio` share by the estimate's, the same for the joint ranking)."""
    length = next(iter(truth.values())).shape[-1]
    k = math.ceil(length * ratio)
    per_head = []
    for i, t in truth.items():
        hit = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, t.topk(k, -1).indices, True)
        per_head.append(hit.gather(-1, estimate[i].topk(k, -1).indices).float().mean(-1))
    flat_t = torch.cat([t.flatten() for t in truth.values()])
    flat_e = torch.cat([e.flatten() for e in estimate.values()])
    total = k * flat_t.numel() // length
    hit = torch.zeros_like(flat_t, dtype=torch.bool).scatter_(0, flat_t.topk(total).indices, True)
    return float(torch.cat(per_head).mean()), float(hit[flat_e.topk(total).indices].float().mean())


@torch.inference_mode()
def scored_document(model, ids, prompt, layers):
    """(a copy-able cache holding the whole document, KVzip's scores and the probe's inputs per layer)."""
    modules = attention_modules(model)
    hidden: dict[int, torch.Tensor] = {}

    def record(i):
        def hook(module, args, kwargs):
            hidden.setdefault(i, kwargs.get("hidden_states", args[0] if args else None)[0].float().clone())
        return hook

    handles = [modules[i].register_forward_pre_hook(record(i), with_kwargs=True) for i in layers]
    try:
        cache = make_cache("kvzip:ratio=1.0,budgets=uniform,span=0", model.config)
        prefill(model, ids, None, cache, repeat_prompt_ids=prompt)
    finally:
        for handle in handles:
            handle.remove()
    length = ids.shape[1]
    truth = {i: cache.layers[i].slots.accumulated[0, :, :length].float() for i in layers}
    return cache, truth, {i: hidden[i][:length] for i in layers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    parser.add_argument("--recent", type=int, default=128)
    parser.add_argument("--span", type=int, default=4)
    parser.add_argument("--split", default="dev")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    model, tok = kba.masked_model(args.model)
    probes = load_probes(None, model.config)
    layers = full_attention_layers(model.config)
    prompt = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, args.lengths, args.depths,
                                           samples_per_cell=args.samples, seed=0, split=args.split)]
    kept: dict[str, int] = {}
    answered, recalls, documents = 0, [], {}
    for n, row in enumerate(rows):
        doc, question = encode(tok, row)
        if tuple(doc) not in documents:  # multi_question asks several questions of one document
            documents.clear()
            documents[tuple(doc)] = scored_document(model, torch.tensor([doc]), prompt, layers)
        cache, truth, hidden = documents[tuple(doc)]
        with torch.inference_mode():
            estimate = {i: estimated_score(probes[i](hidden[i][None]))[0] for i in layers}

        def answer(masks, cache=cache, doc=doc, question=question, row=row):
            kba.MASKS.clear()
            kba.MASKS.update(masks)
            ids = torch.tensor([doc + question])
            with torch.inference_mode():
                out = generate(model, ids, torch.ones_like(ids), copy.deepcopy(cache),
                               max_new_tokens=row["max_new_tokens"])
            kba.MASKS.clear()
            return kba.correct(tok.decode(out.new_tokens[0], skip_special_tokens=True), [row["references"]])

        if not answer({}):
            print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: the uncompressed cache misses",
                  flush=True)
            continue
        answered += 1
        line = []
        for ratio in args.ratios:
            recalls.append((ratio, *recall(estimate, truth, ratio)))
            for source, scores in (("kvzip", truth), ("probe", estimate)):
                for how in ("uniform", "head"):
                    name = f"{source}/{how}/{ratio}"
                    ok = answer(allocate(scores, ratio, how, args.recent, args.span))
                    kept[name] = kept.get(name, 0) + ok
                    line.append(f"{name}={int(ok)}")
        print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: " + " ".join(line), flush=True)
    print(f"\n{args.model} {args.tasks} {args.split} half, lengths {args.lengths}: answers kept of {answered}")
    for name, count in kept.items():
        print(f"{name:>22}: {count} / {answered}")
    for ratio in args.ratios:
        mine = [r for r in recalls if r[0] == ratio]
        print(f"probe's recall of KVzip's kept pairs at {ratio}: per head "
              f"{sum(r[1] for r in mine) / len(mine):.3f}, joint ranking {sum(r[2] for r in mine) / len(mine):.3f}")


if __name__ == "__main__":
    main()
