"""Where KVzip's quarter fails on a model: which full-attention layer's eviction breaks the answer, and where the
needle's tokens rank in each layer's reconstruction scores.

Question: when KVzip keeping a quarter loses the answer (Gemma-3-270M), which layer's eviction breaks it, and which
change of the ranking (pooling, chunks, per-layer floors) brings it back?
Command:
    python benchmarks/probes/kvzip_layer_probe.py [--model gemma-3-270m] [--depths 0 50] [--ratio 0.25]
        [--variants global head oracle:11 whole:11 share:11:0.35 back:3]
Written up: docs/results.md, "Eviction policies side by side (question
after the document)" (why the quarter fails on Gemma-3-270M).

Like benchmarks/probes/kvzip_budget_allocation.py (whose masks it reuses): each needle document is scored once with
`kvzip:ratio=1.0` (nothing evicted), then kept-pair masks are applied while the question is read and answered.
Printed per document: for each full-attention layer, the share of the document's pairs ranked above each needle
token (0.00 = its best-scored token), then the answer under each variant:

- `global`: one ranking of every (layer, head, token) pair (what `kvzip:budgets=head` keeps);
- `head`: the same share in every layer and head (`budgets=uniform`);
- `whole:L`: `global`, but layer L keeps everything;
- `oracle:L`: `global`, plus layer L keeps the needle's sentence (12 tokens before the number, 2 after);
- `share:L:S`: `global`, but layer L keeps its own best share S;
- `back:K`: `global` over scores where each token also takes the best score of its next K tokens;
- `backlayer:K`: each layer keeps as many pairs as `global` gives it, chosen by those `back:K` scores;
- `pool:K` / `poollayer:K`: the same with the best score of the K tokens on either side (a window of 2K + 1);
- `uniformpool:K`: every layer keeps the same share, chosen by those `pool:K` scores;
- `chunk:C`: every layer keeps the same share in whole chunks of C tokens, ranked by their best score (ChunkKV);
- `floorpool:K:F`: `poollayer:K`, but every layer keeps at least F x the uniform share (the others give way).
"""

from __future__ import annotations

import argparse
import copy
import os

import kvzip_budget_allocation as kba
import torch
import torch.nn.functional as F

from hf_kvcompress import make_cache, prefill, repeat_prompt_ids
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples


def masks_for(variant: str, scores: dict, ratio: float, needle: slice | None) -> dict:
    name, *args = variant.split(":")
    if name == "chunk":
        c = int(args[0])
        chunked = {}
        for li, s in scores.items():
            T = s.shape[-1]
            padded = F.pad(s, (0, (-T) % c), value=float("-inf"))
            best = padded.unflatten(-1, (-1, c)).amax(-1, keepdim=True).expand(*padded.shape[:-1], -1, c)
            chunked[li] = best.flatten(-2)[..., :T]
        return kba.allocate(chunked, ratio, 4, "head")
    if name in ("back", "backlayer", "pool", "poollayer", "uniformpool", "floorpool"):
        k = int(args[0])
        before, width = (k, 2 * k + 1) if name.startswith("pool") else (0, k + 1)
        pooled = {li: F.max_pool1d(F.pad(s[0][:, None], (before, k), value=float("-inf")), width, 1)[:, 0][None]
                  for li, s in scores.items()}
        if name == "uniformpool":
            return kba.allocate(pooled, ratio, 4, "head")
        if name == "floorpool":
            counts = {li: m.float().mean().item() for li, m in kba.allocate(scores, ratio, 4, "global").items()}
            floor = float(args[1]) * ratio
            excess = sum(max(0.0, n - floor) for n in counts.values())
            room = ratio * len(counts) - floor * len(counts)
            counts = {li: floor + max(0.0, n - floor) * room / excess for li, n in counts.items()}
            return {li: kba.allocate({li: pooled[li]}, counts[li], 4, "head")[li] for li in scores}
        if name in ("backlayer", "poollayer"):  # each layer keeps as many pairs as the plain global ranking gave it
            counts = {li: m.float().mean().item() for li, m in kba.allocate(scores, ratio, 4, "global").items()}
            return {li: kba.allocate({li: pooled[li]}, counts[li], 4, "head")[li] for li in scores}
        scores, name = pooled, "global"
    if name in ("global", "head"):
        return kba.allocate(scores, ratio, 4, name)
    masks = kba.allocate(scores, ratio, 4, "global")
    layer = int(args[0])
    if name == "whole":
        del masks[layer]
    elif name == "oracle":
        if needle is None:
            raise ValueError("oracle needs the needle's tokens in the document")
        masks[layer][..., max(0, needle.start - 12) : needle.stop + 2] = True
    elif name == "share":
        masks[layer] = kba.allocate({layer: scores[layer]}, float(args[1]), 4, "head")[layer]
    else:
        raise ValueError("variant must be global, head, whole:L, oracle:L, share:L:S, back:K, backlayer:K, pool:K or "
                         f"poollayer:K, got {variant!r}")
    return masks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", type=float, nargs="+", default=[0, 50])
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--variants", nargs="+", default=["global", "head"])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model, tok = kba.masked_model(args.model)
    repeat = repeat_prompt_ids(tok)
    tally: dict[str, list[bool]] = {}
    samples = build_samples(tok, ["needle"], [args.length], args.depths, samples_per_cell=args.samples, seed=0)
    rows = [dict(r) for r in samples]
    for row in rows:
        doc, question = encode(tok, row)
        answer_ids = tok(row["references"][0], add_special_tokens=False).input_ids
        at = [i for i in range(len(doc) - len(answer_ids) + 1) if doc[i : i + len(answer_ids)] == answer_ids]
        needle = slice(at[0], at[0] + len(answer_ids)) if at else None
        cache = make_cache("kvzip:ratio=1.0,budgets=uniform", model.config)
        prefill(model, torch.tensor([doc]), None, cache, repeat_prompt_ids=repeat)
        scores = {i: layer.accumulated[..., : len(doc)].clone() for i, layer in enumerate(cache.layers)
                  if not layer.is_sliding}
        scored = lambda cache=cache: copy.deepcopy(cache)  # noqa: E731
        base = kba.answer(model, tok, doc, question, scored, {}, row["max_new_tokens"])
        refs = [row["references"]]
        print(f"depth {row['depth']}: reference {row['references'][0]}, needle tokens {needle}, "
              f"uncompressed {kba.correct(base, refs)} {base!r}", flush=True)
        if not kba.correct(base, refs):
            continue
        for layer, s in scores.items():
            s = s[0].amax(0)  # best over the layer's KV heads
            if needle is not None:
                above = " ".join(f"{(s > s[p]).float().mean().item():.2f}" for p in range(needle.start, needle.stop))
                print(f"  layer {layer}: share ranked above each needle token: {above}", flush=True)
        for variant in args.variants:
            masks = masks_for(variant, scores, args.ratio, needle)
            text = kba.answer(model, tok, doc, question, scored, masks, row["max_new_tokens"])
            ok = kba.correct(text, refs)
            tally.setdefault(variant, []).append(ok)
            shares = " ".join(f"{li}:{m.float().mean().item():.2f}" for li, m in masks.items())
            print(f"  {variant}: {ok} {text!r} (kept per layer {shares})", flush=True)
    print(f"\n{args.model}, ratio {args.ratio}: answers kept of those the uncompressed cache answered")
    for variant, oks in tally.items():
        print(f"  {variant:>16}: {sum(oks)}/{len(oks)}")


if __name__ == "__main__":
    main()
