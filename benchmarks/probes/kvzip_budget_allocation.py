"""How KVzip's budget is split decides what it keeps: one budget per head, per layer, or one global ranking.

Question: with the same number of kept pairs, which split of KVzip's budget (per head, per layer, one global
ranking, shared tokens) keeps the most answers, by depth band?
Command:
    python benchmarks/probes/kvzip_budget_allocation.py [--model gemma-3-270m] [--lengths 2000]
        [--depths 0 25 50 75 100] [--samples 2] [--ratios 0.5 0.25] [--sinks 0 4]
Written up: docs/results.md, "Eviction policies side by side (question after the document)" (how KVzip's budget is
split).

A measurement to decide what to build, not a cache: each document is prefilled once with `kvzip:ratio=1.0` (the
reconstruction pass scores every pair, nothing is evicted), then each allocation of the same number of kept pairs
is applied as a per-head attention mask over the context while the question is read and answered:

- `head`:   every KV head of every full-attention layer keeps the same share (`kvzip:budgets=uniform`);
- `layer`:  one ranking over all layers' pairs sets each layer's count, shared evenly by its heads
            (close to `kvzip:budgets=layer`);
- `global`: one ranking over all (layer, head, token) pairs (KVzip Sec. 3.3, kvpress's KVzipPress default), so
            heads keep different numbers of pairs (`kvzip:budgets=head`, the default);
- `tokens`: every head of a layer keeps the same tokens, ranked by their best score over the layer's heads, and one
            ranking over all layers' tokens sets each layer's count (rectangular storage, no per-head lengths).

Masks over memory still held: the answers are what a compact per-head store would give; the bytes are not
measured here. Sliding-window layers (Gemma) keep their window and are left out of the ranking. Prints, per
allocation, ratio and sinks, the share of the samples the uncompressed cache answers that it still answers, by
depth band.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections import defaultdict

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.scoring import score_all
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate
from hf_kvcompress.hf.attention import kvcompress_attention, register

MASKS: dict[int, torch.Tensor] = {}  # layer index -> [1, H_kv, T_context] bool: kept pairs of the context


def masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """kvcompress_sdpa with each KV head's evicted context pairs masked out."""
    keep = MASKS.get(module.layer_idx)
    if keep is not None:
        batch, q_heads, q_len, _ = query.shape
        kv_len = key.shape[2]
        groups = q_heads // keep.shape[1]
        per_head = torch.ones(batch, q_heads, q_len, kv_len, dtype=torch.bool)
        per_head[..., : keep.shape[-1]] = keep.repeat_interleave(groups, dim=1)[:, :, None, :]
        if attention_mask is None:
            q_pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
            attention_mask = (torch.arange(kv_len)[None, :] <= q_pos)[None, None]
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask[..., :kv_len] & per_head
        else:
            attention_mask = attention_mask[..., :kv_len].masked_fill(~per_head, float("-inf"))
    return kvcompress_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def masked_model(name: str):
    """(model, tokenizer) of `name` on the package's attention, scoring with `masked_attention`: the probes'
    allocations mask pairs out instead of evicting them, so one prefill serves every allocation tried."""
    model, tok = load_model(name)
    use_kvcompress_attention(model)
    register()
    AttentionInterface.register("kvzip_masked", masked_attention)
    AttentionMaskInterface.register("kvzip_masked", sdpa_mask)
    model.set_attn_implementation("kvzip_masked")
    return model, tok


def allocate(scores: dict[int, torch.Tensor], ratio: float, sinks: int, how: str) -> dict[int, torch.Tensor]:
    """Kept-pair masks [1, H, T] per layer, the same total (ratio x pairs) for every allocation."""
    T = next(iter(scores.values())).shape[-1]
    scores = {li: s.clone() for li, s in scores.items()}
    for s in scores.values():
        s[..., :sinks] = float("inf")
    H = next(iter(scores.values())).shape[1]
    per_head = math.ceil(T * ratio)
    total = per_head * H * len(scores)
    if how == "head":
        counts = {li: torch.full((H,), per_head) for li in scores}
    elif how == "tokens":
        best = {li: s.amax(dim=1, keepdim=True).expand_as(s) for li, s in scores.items()}
        flat = torch.cat([b[:, 0].flatten() for b in best.values()])
        threshold = flat.topk(per_head * len(scores)).values[-1]
        counts = {li: (b[0] >= threshold).sum(-1) for li, b in best.items()}
        scores = best
    else:
        flat = torch.cat([s.flatten() for s in scores.values()])
        threshold = flat.topk(total).values[-1]
        if how == "global":
            counts = {li: (s[0] >= threshold).sum(-1) for li, s in scores.items()}
        elif how == "layer":
            counts = {}
            for li, s in scores.items():
                n = int((s >= threshold).sum())
                counts[li] = torch.full((H,), n // H) + (torch.arange(H) < n % H).long()
        else:
            raise ValueError(f"allocation must be head, layer, global or tokens, got {how!r}")
    masks = {}
    for li, s in scores.items():
        mask = torch.zeros(1, H, T, dtype=torch.bool)
        order = s[0].argsort(dim=-1, descending=True)
        for h in range(H):
            mask[0, h, order[h, : int(counts[li][h])]] = True
        masks[li] = mask
    return masks


def correct(text: str, refs) -> bool:
    return score_all([text], refs)["string_match_all"][0] >= 50


@torch.inference_mode()
def answer(model, tok, doc, question, scored_cache_builder, masks, max_new_tokens):
    cache = scored_cache_builder()
    MASKS.clear()
    MASKS.update(masks)
    ids = torch.tensor([doc + question])
    mask = torch.ones_like(ids)
    result = generate(model, ids, mask, cache, max_new_tokens=max_new_tokens)
    MASKS.clear()
    return tok.decode(result.new_tokens[0], skip_special_tokens=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="needle")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--allocations", nargs="+", default=["head", "layer", "global", "tokens"])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    model, tok = masked_model(args.model)
    repeat = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, [args.task], args.lengths, args.depths,
                                           samples_per_cell=args.samples, seed=0)]
    kept = defaultdict(lambda: defaultdict(list))  # (how, ratio, sinks) -> band -> [kept?] over baseline-correct
    for n, row in enumerate(rows):
        doc, question = encode(tok, row)
        ids = torch.tensor([doc])
        cache = make_cache("kvzip:ratio=1.0,budgets=uniform", model.config)
        prefill(model, ids, None, cache, repeat_prompt_ids=repeat)
        scores = {i: layer.accumulated[..., : len(doc)].clone() for i, layer in enumerate(cache.layers)
                  if not layer.is_sliding}

        def scored_cache(cache=cache):  # a copy of the scored, unevicted document cache for each answer
            return copy.deepcopy(cache)

        refs = [row["references"]]
        base = answer(model, tok, doc, question, scored_cache, {}, row["max_new_tokens"])
        if not correct(base, refs):
            print(f"[{n + 1}/{len(rows)}] depth {row['depth']}: baseline misses", flush=True)
            continue
        band = "start" if row["depth"] <= 25 else "middle" if row["depth"] < 75 else "end"
        line = []
        for ratio in args.ratios:
            for sinks in args.sinks:
                for how in args.allocations:
                    text = answer(model, tok, doc, question, scored_cache, allocate(scores, ratio, sinks, how),
                                  row["max_new_tokens"])
                    ok = correct(text, refs)
                    kept[(how, ratio, sinks)][band].append(ok)
                    line.append(f"{how}/{ratio}/s{sinks}={int(ok)}")
        print(f"[{n + 1}/{len(rows)}] depth {row['depth']}: " + " ".join(line), flush=True)
    print(f"\n{args.model} {args.task} lengths {args.lengths}: retention (kept / baseline-correct) by band")
    print(f"{'allocation':>10} {'ratio':>6} {'sinks':>5} {'all':>10} {'start':>8} {'middle':>8} {'end':>8}")
    for (how, ratio, sinks), bands in sorted(kept.items(), key=lambda kv: (-kv[0][1], kv[0][2], kv[0][0])):
        everything = [v for b in bands.values() for v in b]
        cells = [f"{sum(bands[b])}/{len(bands[b])}" if bands[b] else "-" for b in ("start", "middle", "end")]
        print(f"{how:>10} {ratio:>6} {sinks:>5} {sum(everything) / len(everything):>5.2f} ({len(everything):>2}) "
              + " ".join(f"{c:>8}" for c in cells))


if __name__ == "__main__":
    main()
