"""How much each layer's low-rank cache costs a copy of the document, and an allocation weighted by it.

Question: the quarter's misses come back when some layers (not the same ones for every sample) keep exact caches
(lowrank_layer_exact.py), while the error allocation weighs every layer's own attention-output error alike. How much
does each layer at the spec's ranks, alone (every other layer exact), raise the model's loss on a copy of text it
has just read (the text prefilled and encoded, then the same text again, as KVzip's reconstruction task), and does an
allocation that weighs each layer's calibrated error curves by that cost answer more?
Command:
    python benchmarks/probes/lowrank_copy_sensitivity.py [--model smollm2-135m] [--spec lowrank:ratio=0.25]
        [--tokens 1024] [--out DIR]
Written up: docs/results.md, "Low rank at a quarter: exact outliers and copy weights".

With `--out DIR`, writes copies of the model's shipped bases whose error curves are multiplied by each layer's weight
(`weightings`: DIR/ratio and DIR/boost), for `lowrank:ratio=...,bases=DIR/boost` (the error allocation reads the
weighted curves).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.calibration import ERROR_STEP, held_out_ids, load_bases, save_bases
from hf_kvcompress.codecs.identity import IdentityCodec


def copy_loss(model, ids: torch.Tensor, cache) -> float:
    """Mean next-token loss over the second reading of `ids`, after the first was prefilled into `cache`."""
    model(input_ids=ids, cache=cache)
    logits = model(input_ids=ids, cache=cache).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--spec", default="lowrank:ratio=0.25")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    ids = held_out_ids(tok, 2048, args.tokens)
    base = copy_loss(model, ids, DynamicCache())
    tensors, meta = load_bases(None, model.config)
    ranks = make_cache(args.spec, model.config).codec._ranks
    print(f"{args.model} {args.spec}: copy loss with every layer exact {base:.4f}", flush=True)
    rises, owns = [], []
    for layer_idx, (key_rank, value_rank) in enumerate(ranks):
        cache = make_cache(args.spec, model.config)
        for other, old in enumerate(cache.layers):
            if other != layer_idx:
                cache.layers[other] = CompressedLayer(old.policy, IdentityCodec(), old.is_sliding,
                                                      attention_window=old.attention_window)
        rises.append(copy_loss(model, ids, cache) - base)
        owns.append(float(tensors[f"layers.{layer_idx}.key_error"][key_rank // ERROR_STEP]
                          + tensors[f"layers.{layer_idx}.value_error"][value_rank // ERROR_STEP]))
        print(f"layer {layer_idx:2d} ranks {key_rank:3d}/{value_rank:3d}: copy loss +{rises[-1]:.4f}, own error "
              f"{owns[-1]:.3f}", flush=True)
    if args.out:
        for name, weights in weightings(rises, owns).items():
            print(f"{name} weights: " + " ".join(f"{w:.2f}" for w in weights))
            print(f"wrote {write_weighted(tensors, meta, weights, Path(args.out) / name)}")


def weightings(rises: list[float], owns: list[float]) -> dict[str, list[float]]:
    """Per-layer weights of the error curves, each divided by its mean: "ratio", the copy-loss rise over the layer's
    own calibrated error (the curves then read as copy loss); "boost", 1 plus the rise over the mean rise (every
    layer keeps its own curve, the costly ones count more)."""
    ratio = [max(rise, 1e-4) / max(own, 1e-4) for rise, own in zip(rises, owns, strict=True)]
    positive = [max(rise, 0.0) for rise in rises]
    mean_rise = max(sum(positive) / len(positive), 1e-9)
    boost = [1 + rise / mean_rise for rise in positive]
    return {name: [w * len(ws) / sum(ws) for w in ws] for name, ws in (("ratio", ratio), ("boost", boost))}


def write_weighted(tensors: dict, meta: dict, weights: list[float], out: Path) -> Path:
    """A copy of the bases whose layer i's key and value error curves are multiplied by weights[i]."""
    weighted = dict(tensors)
    for layer_idx, weight in enumerate(weights):
        for kind in ("key", "value"):
            name = f"layers.{layer_idx}.{kind}_error"
            weighted[name] = tensors[name] * weight
    return save_bases(weighted, dict(meta), out)

if __name__ == "__main__":
    main()
