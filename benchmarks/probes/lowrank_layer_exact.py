"""Which layers' low-rank errors lose a quarter's answers, and whether the reconstruction error finds the answer.

Question: on the samples that `lowrank:ratio=0.25` misses (and `dynamic` answers), does keeping the keys and
values of some decoder layers exact (those layers' caches full precision, the others as the spec stores them) bring
the answer back, and which layers do? And where do the answer's own tokens rank among each layer's tokens by the
codec's reconstruction error (`token_errors`: what exact outliers, ShadowKV's, would have kept)?
Command:
    python benchmarks/probes/lowrank_layer_exact.py [--model smollm2-135m] [--spec lowrank:ratio=0.25]
        [--tasks needle multi_question] [--split dev] [--depths 10 50 90] [--samples 2] [--group 6]
Written up: docs/results.md, "Low rank at a quarter: exact outliers and copy weights".

Each prompt is answered as the eval's document-first protocol does (the document prefilled, then the question
generated from the cache). For a missed sample, the layers are made exact `--group` at a time (consecutive
layers), then one at a time within each group that brings the answer back.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, prefill


def answer(model, tok, row, doc, question, spec, exact_layers=()):
    """The generated text and whether every reference is in it, with `exact_layers` stored at full precision."""
    cache = make_cache(spec, model.config)
    for i in exact_layers:
        old = cache.layers[i]
        cache.layers[i] = CompressedLayer(old.policy, IdentityCodec(), old.is_sliding,
                                          attention_window=old.attention_window)
    if spec != "dynamic":
        prefill(model, torch.tensor([doc]), None, cache)
    result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=row["max_new_tokens"])
    text = tok.decode(result.new_tokens[0], skip_special_tokens=True)
    return text, all(ref in text for ref in row["references"]), cache


def token_errors(codec, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys, values [B, H_kv, T, D] -> [B, T]: each token's squared error once encoded and decoded by a layer's
    `codec` (its storage included), over the layer's KV heads, keys and values each divided by their mean over the
    T tokens so that the two kinds weigh alike; keys at `positions` [B, H_kv, T] for a codec that needs them."""
    total = torch.zeros(keys.shape[0], keys.shape[2])
    for kind, states in (("key", keys), ("value", values)):
        at = {"positions": positions} if kind == "key" and codec.needs_positions else {}
        rebuilt = codec.decode(codec.encode(states, kind, **at), kind, torch.float32, **at)
        error = (rebuilt - states.float()).square().sum(dim=(1, 3))  # [B, T]
        total += error / error.mean(dim=-1, keepdim=True).clamp(min=1e-30)
    return total


def answer_ranks(model, tok, row, doc, spec):
    """Per layer, the answer tokens' best rank percentile by `token_errors` (0: the worst-read token)."""
    reference = DynamicCache()  # every layer's states whole (a sliding layer's too)
    with torch.no_grad():
        model(input_ids=torch.tensor([doc]), cache=reference)
    codec_cache = make_cache(spec, model.config)
    spans = []
    for ref in row["references"]:
        ids = tok(ref, add_special_tokens=False).input_ids
        for i in range(len(doc) - len(ids) + 1):
            if doc[i : i + len(ids)] == ids:
                spans.extend(range(i, i + len(ids)))
    if not spans:
        return []
    positions = torch.arange(len(doc))[None, None]
    ranks = []
    for exact, layer in zip(reference.layers, codec_cache.layers, strict=True):
        heads = exact.keys.shape[1]
        errors = token_errors(layer.codec, exact.keys, exact.values, positions.expand(1, heads, -1))[0]
        order = errors.argsort(descending=True).argsort().float() / len(doc)  # 0: the worst
        ranks.append(float(order[spans].min()))
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--spec", default="lowrank:ratio=0.25")
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--group", type=int, default=6)
    parser.add_argument("--skip-layers", action="store_true", help="only the answer tokens' error ranks")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    rows = [dict(r) for r in build_samples(tok, args.tasks, [2000], args.depths, samples_per_cell=args.samples,
                                           split=args.split)]  # fmt: skip
    layers = model.config.num_hidden_layers
    for row in rows:
        doc, question = encode(tok, row)
        ranks = answer_ranks(model, tok, row, doc, args.spec)
        shown = " ".join(f"{r:.2f}" for r in ranks)
        text, right, _ = answer(model, tok, row, doc, question, args.spec)
        print(f"{row['sample_id']} {args.spec}: correct={right} {text!r} (references {row['references']})")
        print(f"  answer tokens' best error rank per layer (0 = worst-read token): {shown}", flush=True)
        if right or args.skip_layers:
            continue
        if not answer(model, tok, row, doc, question, "dynamic")[1]:
            print("  dynamic misses it too", flush=True)
            continue
        for start in range(0, layers, args.group):
            group = range(start, min(layers, start + args.group))
            text, right, _ = answer(model, tok, row, doc, question, args.spec, group)
            print(f"  layers {group.start}-{group.stop - 1} exact: correct={right} {text!r}", flush=True)
            if right and len(group) > 1:
                for i in group:
                    text, one, _ = answer(model, tok, row, doc, question, args.spec, [i])
                    print(f"    layer {i} exact: correct={one} {text!r}", flush=True)


if __name__ == "__main__":
    main()
