"""Low rank: how much of each layer's attention output each key and value rank loses, and which allocation of a
share of the dimensions loses least.

Question: (issue 30, a quarter of the dimensions) the shipped ranks come from the calibrated variances; does an
attention-output error target (LoRC, Eigen Attention) spend the same dimensions better, and how should they split
between keys and values? For every layer the shipped joint bases reconstruct the keys (pre-RoPE, rotated back) or
the values at each rank (steps of 8), the other kind exact; the layer's attention output after its output
projection, for the last `--queries` tokens of the text, is compared with the exact one (relative squared error).
Allocations of each of `--ratios` are then scored on held-out text (SQuAD paragraphs) with both kinds rebuilt at
once: the sum over layers of the relative errors.
Command:
    python benchmarks/probes/lowrank_attention_error.py --model smollm2-135m --ratios 0.25,0.5
Written up: docs/results.md, "Low rank at a quarter: ranks by attention-output error and a window".
"""

from __future__ import annotations

import argparse

from hf_kvcompress.calibration import (
    attention_captures,
    calibration_ids,
    error_curves,
    joint_reconstruction,
    load_bases,
    output_error,
)
from hf_kvcompress.codecs.lowrank import allocate_ranks, allocate_ranks_by_error
from hf_kvcompress.eval.data import squad_questions
from hf_kvcompress.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--fit-tokens", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--step", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    tensors, meta = load_bases(None, model.config)
    layers, max_rank = int(meta["layers"]), int(meta["max_rank"])
    fit = attention_captures(model, calibration_ids(tokenizer, args.fit_tokens), args.queries)
    curves = error_curves(model, fit, tensors, args.step, max_rank)
    for i, (key, value) in enumerate(curves):
        print(f"layer {i:2d} keys  " + " ".join(f"{e:.3f}" for e in key[: 1 + max_rank // args.step // 2]))
        print("         values " + " ".join(f"{e:.3f}" for e in value[: 1 + max_rank // args.step // 2]))
    _, paragraphs, _ = squad_questions()
    held_out = tokenizer("\n\n".join(paragraphs[:80]), return_tensors="pt").input_ids[:, : args.fit_tokens]
    test = attention_captures(model, held_out, args.queries)
    variances = [(tensors[f"layers.{i}.key_variance"], tensors[f"layers.{i}.value_variance"]) for i in range(layers)]
    width = variances[0][0].numel()
    for ratio in (float(r) for r in args.ratios.split(",")):
        uniform = int(round(ratio * width / args.step)) * args.step
        plans = {
            "variance": allocate_ranks(variances, ratio, args.step, max_rank),
            "error": allocate_ranks_by_error(curves, ratio, args.step, max_rank, width),
            "uniform": [(uniform, uniform)] * layers,
        }
        for name, ranks in plans.items():
            errors = [output_error(model, test[i], joint_reconstruction(model.config, tensors, i, test[i], ranks[i]),
                                   i) for i in range(layers)]
            keys, values = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
            print(f"ratio {ratio} {name:9s} held-out error sum {sum(errors):.3f}  max {max(errors):.3f}  "
                  f"keys {keys} values {values}")
            print("          per layer " + " ".join(f"{e:.2f}" for e in errors))
            print("          ranks     " + " ".join(f"{k}/{v}" for k, v in ranks))

if __name__ == "__main__":
    main()
