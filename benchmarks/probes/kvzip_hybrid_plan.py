"""How a plain KVzip ratio should share a hybrid model's kept pairs between sliding-window and full-attention layers.

Question: at the same share of the cache's pairs, how many tokens should the sliding-window layers keep, and how
should the full-attention layers rank theirs (one ranking of every pair, the same tokens in every layer, or a mix),
for KVzip to keep the answers on Gemma-3's development half? And which full-attention layers lose the fact's tokens?
Command:
    python benchmarks/probes/kvzip_hybrid_plan.py [--model gemma-3-270m] [--tasks needle multi_question]
        [--lengths 2000] [--depths 10 50 90] [--samples 2] [--targets 0.5 0.25 0.125] [--sliding 511 127 63 31]
        [--allocations head token uniform] [--skip-whole]
Written up: docs/results.md, "Plain KVzip ratios on Gemma-3: the plan shares the bytes" (issue 27).

Each document (dev half) is prefilled once per sliding count S (the first: the whole window, for the uncompressed
answers) with `kvzip:ratio=1.0,budgets=uniform,sliding=S`:
the sliding layers keep their newest S tokens as the real cache does, the full-attention layers keep everything and
hold their reconstruction scores. Each allocation then keeps, as per-head attention masks over the full-attention
layers' context, the number of pairs that leaves the whole cache at the target share of its uncompressed pairs:
    full share = (target x (sliding layers x min(T, window - 1) + full layers x T) - sliding layers x S)
                 / (full layers x T).
Allocations (each with KVzip's span=4 choosing the pairs, the raw scores setting the counts):
- `head`:    one ranking of every (layer, KV head, token) pair (`budgets=head`, the default);
- `token`:   each token scored by its best over every full-attention layer and head, the same tokens everywhere
             (`budgets=token`);
- `mix:A`:   `head` over each pair's max(own score, A x its token's best over every layer and head);
- `uniform`: the same share in every layer and head, each by its own scores (`budgets=uniform`);
- `rank`:    like `token`, but each token takes its best place in any layer's and head's own ranking (so a layer
             whose scores are small counts as much as one whose scores are large);
- `floor:F`: `head`, but every layer and head keeps at least F x the uniform share (the others give way);
- `lfloor:L=F,L=F`: `head`, but each head of the named layers keeps its best F of the document first (the cache's
             calibrated layer floors), the one ranking shares out the rest;
- `shares:L=F,L=F`: the named full-attention layers keep those shares of the document per head, the others split
             what is left equally (a diagnosis, as `layer:L:F`);
- `layer:L:F`: layer L keeps F of the document per head, the other full-attention layers share what is left equally
             (each by its own scores): a diagnosis of what one layer needs, not a plan (it names a layer).
Printed per document: where each fact's tokens rank in each full-attention layer and whether each allocation keeps
them, then the answer of each (target, S, allocation); at the end, retention (kept / answered uncompressed) per cell.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections import defaultdict

import kvzip_budget_allocation as kba
import torch

from hf_kvcompress import make_cache, prefill, repeat_prompt_ids
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import band_of, build_samples
from hf_kvcompress.hf.compat import text_config
from hf_kvcompress.policies.kvzip import best_ahead

SPAN = 4


def keep_masks(scores: dict[int, torch.Tensor], share: float, how: str) -> dict[int, torch.Tensor]:
    """[1, H, T] kept-pair masks per full-attention layer, `ceil(share x T)` pairs per head on average."""
    T = next(iter(scores.values())).shape[-1]
    H = next(iter(scores.values())).shape[1]
    per_head = min(T, math.ceil(share * T))
    total = per_head * H * len(scores)
    chooser = {li: best_ahead(s, SPAN) for li, s in scores.items()}
    name, *args = how.split(":")
    if name == "token":
        best = torch.stack([s.amax(dim=1) for s in scores.values()]).amax(0)  # [1, T]
        chooser = {li: best_ahead(best[:, None].expand_as(s), SPAN) for li, s in scores.items()}
        counts = {li: torch.full((H,), per_head) for li in scores}
    elif name == "rank":  # each pair's place in its own head's ranking (1 = its best), best over layers and heads
        places = [s.argsort(-1).argsort(-1).double() / max(T - 1, 1) for s in scores.values()]
        best = torch.stack([p.amax(dim=1) for p in places]).amax(0)  # [1, T]
        chooser = {li: best_ahead(best[:, None].expand_as(s), SPAN) for li, s in scores.items()}
        counts = {li: torch.full((H,), per_head) for li in scores}
    elif name == "mix":  # mix:A: each pair scores max(its own, A x its token's best over every layer and head)
        best = torch.stack([s.amax(dim=1) for s in scores.values()]).amax(0)  # [1, T]
        mixed = {li: torch.maximum(s, float(args[0]) * best[:, None]) for li, s in scores.items()}
        chooser = {li: best_ahead(m, SPAN) for li, m in mixed.items()}
        flat = torch.cat([m.flatten() for m in mixed.values()])
        threshold = flat.topk(total).values[-1]
        counts = {li: (m[0] >= threshold).sum(-1).clamp(max=T) for li, m in mixed.items()}
    elif name == "uniform":
        counts = {li: torch.full((H,), per_head) for li in scores}
    elif name == "layer":
        favoured, favoured_share = int(args[0]), float(args[1])
        if favoured not in scores:
            raise ValueError(f"layer:L:F needs a full-attention layer L, one of {sorted(scores)}, got {favoured}")
        first = min(T, math.ceil(favoured_share * T))
        rest = min(T, max(0, (total - first * H) // (H * (len(scores) - 1)))) if len(scores) > 1 else 0
        counts = {li: torch.full((H,), first if li == favoured else rest) for li in scores}
    elif name == "shares":  # shares:5=0.1,11=0.45: the named layers keep those shares, the others split the rest
        named = {int(k): float(v) for k, v in (part.split("=") for part in args[0].split(","))}
        if not set(named) <= set(scores):
            raise ValueError(f"shares: names full-attention layers, among {sorted(scores)}, got {sorted(named)}")
        fixed = {li: min(T, math.ceil(f * T)) for li, f in named.items()}
        others = [li for li in scores if li not in named]
        rest = max(0, total - sum(fixed.values()) * H) // (H * len(others)) if others else 0
        counts = {li: torch.full((H,), fixed.get(li, min(T, rest))) for li in scores}
    elif name in ("head", "floor", "lfloor"):
        floor = float(args[0]) if args and name == "floor" else 0.0
        # lfloor:17=0.25,5=0.1: those layers' heads keep their best share of the document first (the cache's
        # calibrated layer floors, plan.py `SlidingShare.floors`), the one ranking shares out the rest
        named = ({int(k): float(v) for k, v in (part.split("=") for part in args[0].split(","))}
                 if name == "lfloor" else {})
        # each head's first `guaranteed` pairs by its own ranking are protected; the rest is one global ranking
        ranked = {}
        for li, s in scores.items():
            guaranteed = min(T, math.ceil(named[li] * T)) if li in named else min(T, math.floor(floor * per_head))
            order = s[0].argsort(-1, descending=True)
            lifted = s[0].clone()
            if guaranteed:
                lifted.scatter_(1, order[:, :guaranteed], float("inf"))
            ranked[li] = lifted
        flat = torch.cat([r.flatten() for r in ranked.values()])
        threshold = flat.topk(total).values[-1]
        counts = {li: (r >= threshold).sum(-1).clamp(max=T) for li, r in ranked.items()}
    else:
        raise ValueError(
            f"allocation must be head, token, rank, mix:A, uniform, floor:F, lfloor:L=F,..., layer:L:F or "
            f"shares:L=F,..., got {how!r}")
    masks = {}
    for li, c in chooser.items():
        mask = torch.zeros(1, H, T, dtype=torch.bool)
        order = c[0].argsort(-1, descending=True)
        for h in range(H):
            mask[0, h, order[h, : int(counts[li][h])]] = True
        masks[li] = mask
    return masks


def fact_span(tok, doc: list[int], value: str) -> slice | None:
    """Where `value`'s tokens sit in the document (with or without a leading space)."""
    for text in (" " + value, value):
        ids = tok(text, add_special_tokens=False).input_ids
        for i in range(len(doc) - len(ids) + 1):
            if doc[i : i + len(ids)] == ids:
                return slice(i, i + len(ids))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--sliding", type=int, nargs="+", default=[511, 127, 63])
    parser.add_argument("--allocations", nargs="+", default=["head", "token", "uniform"])
    parser.add_argument("--shares", type=float, nargs="+", default=[],
                        help="also keep these shares of the document in the full-attention layers at every sliding "
                             "count, whatever the cache's total (a diagnosis: what the sliding layers' tokens add)")
    parser.add_argument("--skip-whole", action="store_true",
                        help="score the whole window only for the uncompressed answers (no allocation there)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    args.sliding_tried = [S for S in args.sliding if not (args.skip_whole and S == max(args.sliding))]

    model, tok = kba.masked_model(args.model)
    decoder = text_config(model.config)
    types = decoder.layer_types
    window = decoder.sliding_window
    n_sliding = sum(t == "sliding_attention" for t in types)
    n_full = len(types) - n_sliding
    repeat = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, args.lengths, args.depths, samples_per_cell=args.samples,
                                           seed=0, split=args.split)]  # fmt: skip
    documents: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        doc, question = encode(tok, row)
        documents[tuple(doc)].append({**row, "question_ids": question})
    kept = defaultdict(lambda: defaultdict(list))  # (target, S, how) -> band -> [bool]
    for n, (doc_key, questions) in enumerate(documents.items()):
        doc = list(doc_key)
        T = len(doc)
        base_cache = None
        answered = []
        for S in args.sliding:
            # an explicit sliding= keeps the plain share: nothing is planned, the full layers keep every pair
            spec = f"kvzip:ratio=1.0,budgets=uniform,sliding={min(S, window - 1)}"
            cache = make_cache(spec, model.config)
            prefill(model, torch.tensor([doc]), None, cache, repeat_prompt_ids=repeat)
            scores = {i: layer.accumulated[..., :T].clone() for i, layer in enumerate(cache.layers)
                      if not layer.is_sliding}  # fmt: skip
            if base_cache is None:  # the uncompressed answers (S = the whole window first)
                for q in questions:
                    text = kba.answer(model, tok, doc, q["question_ids"], lambda c=cache: copy.deepcopy(c), {},
                                      q["max_new_tokens"])  # fmt: skip
                    q["base_ok"] = kba.correct(text, [q["references"]])
                    where = fact_span(tok, doc, q["references"][0])
                    ranks = []
                    for li, s in scores.items():
                        if where is not None:
                            share_above = (s[0, 0][None, :] > s[0, 0, where][:, None]).float().mean(-1)
                            ranks.append(f"L{li}:" + "/".join(f"{v:.2f}" for v in share_above.tolist()))
                    print(f"[doc {n + 1}/{len(documents)}] {q['task']} depth {q['depth']} base_ok={q['base_ok']} "
                          f"fact {q['references'][0]!r} at {where}; share of pairs above its tokens: "
                          + " ".join(ranks), flush=True)  # fmt: skip
                base_cache = cache
                answered = [q for q in questions if q["base_ok"]]
            if not answered:
                break
            if S not in args.sliding_tried:
                continue
            cells = [(target, (target * (n_sliding * min(T, window - 1) + n_full * T) - n_sliding * min(S, T))
                      / (n_full * T)) for target in args.targets]
            cells += [(f"full={share:g}", share) for share in args.shares]
            for target, share in cells:
                if share <= 0 or share > 1:
                    continue
                for how in args.allocations:
                    masks = keep_masks(scores, share, how)
                    line = []
                    for q in answered:
                        where = fact_span(tok, doc, q["references"][0])
                        held = ("/".join(f"{masks[li][0, :, where].float().mean():.1f}" for li in masks)
                                if where is not None else "?")  # fmt: skip
                        text = kba.answer(model, tok, doc, q["question_ids"], lambda c=cache: copy.deepcopy(c), masks,
                                          q["max_new_tokens"])  # fmt: skip
                        ok = kba.correct(text, [q["references"]])
                        kept[(target, S, how)][band_of(q["depth"])].append(ok)
                        line.append(f"d{q['depth']:g}={int(ok)}[{held}]{'' if ok else repr(text[:20])}")
                    kept_shares = "/".join(f"{masks[li].float().mean():.2f}" for li in masks)
                    print(f"  target {target} S={S} full share {share:.3f} {how} (layers keep {kept_shares}): "
                          + " ".join(line), flush=True)
    print(f"\n{args.model} {args.tasks} {args.lengths} {args.split}: retention by band (kept / answered)")
    for (target, S, how), bands in sorted(kept.items(), key=lambda kv: (str(kv[0][0]), -kv[0][1], kv[0][2])):
        every = [v for b in bands.values() for v in b]
        cells = " ".join(f"{b}={sum(bands[b])}/{len(bands[b])}" for b in ("start", "middle", "end") if bands[b])
        share = sum(every) / len(every)
        print(f"target {target!s:<9} S={S:<4} {how:<10} {sum(every)}/{len(every)} = {share:.2f}  {cells}")


if __name__ == "__main__":
    main()
