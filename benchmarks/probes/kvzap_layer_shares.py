"""Where does the probe's joint ranking differ from KVzip's: in how many pairs each layer gets, or which ones?

Question: at one ratio, per full-attention layer, how many pairs does one joint ranking of every layer's pairs give
each layer by KVzip's scores and by the probe's estimates, and are the answer's tokens (the reference's tokens found
in the document) kept by (KVzip's counts, KVzip's order), (the probe's counts, the probe's order), (KVzip's counts,
the probe's order) and (the probe's counts, KVzip's order)?
Command:
    python benchmarks/probes/kvzap_layer_shares.py [--model gemma-3-270m] [--ratio 0.25] [--split dev]
        [--extra 480] [--recent 128] [--documents 6] [--probe FILE]
Written up: docs/results.md, "KVzap at a quarter".

A measurement of scores only (no answers): each document's KVzip scores and hidden states come from one
`kvzip:ratio=1.0` prefill (kvzap_allocation.py `scored_document`). `--extra`: pairs per KV head each full-attention
layer keeps beyond the ratio's share (what the sliding layers give up, plan.py `SlidingShare`: 480 on Gemma-3-270M
at a quarter of 2000 tokens; 0 on a model without sliding layers).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from kvzap_allocation import scored_document

from hf_kvcompress import load_model, repeat_prompt_ids
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.probe_calibration import full_attention_layers
from hf_kvcompress.probes import estimated_score, load_probes


def joint_counts(scores: dict[int, torch.Tensor], total: int) -> dict[int, torch.Tensor]:
    """[H] pairs each layer's heads keep under one ranking of every pair (ties: as many as reach the threshold)."""
    threshold = torch.cat([s.flatten() for s in scores.values()]).topk(total).values[-1]
    return {i: (s >= threshold).sum(-1) for i, s in scores.items()}


def kept(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[H, T] bool: each head's `counts` best `scores` [H, T]."""
    order = scores.argsort(-1, descending=True)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for h in range(scores.shape[0]):
        mask[h, order[h, : int(counts[h])]] = True
    return mask


def answer_positions(tok, doc: list[int], references) -> list[int]:
    """Positions in `doc` of the first occurrence of any reference's tokens (with or without a leading space)."""
    out = []
    for ref in references if isinstance(references, (list, tuple)) else [references]:
        for text in (f" {ref}", str(ref)):
            ids = tok(text, add_special_tokens=False).input_ids
            for s in range(len(doc) - len(ids) + 1):
                if doc[s : s + len(ids)] == ids:
                    out += list(range(s, s + len(ids)))
                    break
            else:
                continue
            break
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--extra", type=int, default=480)
    parser.add_argument("--recent", type=int, default=128)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--probe", default=None, help="a probe file (default: the one shipped for the model)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    model, tok = load_model(args.model)
    probes = load_probes(args.probe, model.config)
    layers = full_attention_layers(model.config)
    prompt = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, [2000], args.depths, samples_per_cell=2, seed=0,
                                           split=args.split)]
    done: set[tuple] = set()
    for row in rows:
        doc, _ = encode(tok, row)
        if tuple(doc) in done:
            continue
        done.add(tuple(doc))
        if len(done) > args.documents:
            break
        _, truth, hidden = scored_document(model, torch.tensor([doc]), prompt, layers)
        with torch.inference_mode():
            estimate = {i: estimated_score(probes[i](hidden[i][None]))[0] for i in layers}
        length, heads = len(doc), truth[layers[0]].shape[0]
        protect = torch.zeros(length, dtype=torch.bool)
        protect[length - args.recent :] = True
        truth = {i: s.masked_fill(protect, float("inf")) for i, s in truth.items()}
        estimate = {i: s.masked_fill(protect, float("inf")) for i, s in estimate.items()}
        total = (math.ceil(length * args.ratio) + args.extra) * heads * len(layers)
        by_truth, by_probe = joint_counts(truth, total), joint_counts(estimate, total)
        where = answer_positions(tok, doc, row["references"])
        print(f"{row['task']} depth {row['depth']}: answer tokens at {where[:1]}..{where[-1:]} ({len(where)})")
        for i in layers:
            line = [f"  L{i}: pairs per head KVzip {by_truth[i].tolist()} probe {by_probe[i].tolist()}"]
            for name, counts, scores in (("kvzip", by_truth[i], truth[i]), ("probe", by_probe[i], estimate[i]),
                                         ("kvzip counts+probe order", by_truth[i], estimate[i]),
                                         ("probe counts+kvzip order", by_probe[i], truth[i])):
                mask = kept(scores, counts)
                got = mask[:, where].float().mean().item() if where else float("nan")
                line.append(f"{name} {got:.2f}")
            top = kept(truth[i], by_truth[i])
            recall = (kept(estimate[i], by_truth[i]) & top).sum().item() / max(top.sum().item(), 1)
            print(" | ".join(line) + f" | probe's recall of KVzip's kept pairs {recall:.2f}", flush=True)


if __name__ == "__main__":
    main()
