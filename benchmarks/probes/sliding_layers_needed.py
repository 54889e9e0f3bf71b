"""Which of a hybrid model's sliding-window layers need their whole window for multi_needle's answers?

Question: KVzip's plan at a quarter cuts every sliding layer of Gemma-3-270M to its 16 newest tokens, and with every
full-attention pair kept that cut alone answers another needle's number on multi_needle (the section named below). Do
all fifteen sliding layers need their window back, or a few (those before the first full-attention layer, between
two, after the last)? Nothing is evicted from the full-attention layers here (`dynamic:sliding=S`, no KVzip pass):
only the sliding layers' count moves.
Command:
    python benchmarks/probes/sliding_layers_needed.py [--model gemma-3-270m] [--split dev] [--depths 10 50 90]
        [--samples 4] [--sliding 16] [--whole 0-4 6-10 12-16]
Written up: docs/results.md, "KVzip at a quarter on Gemma-3's multi_needle: the sliding layers' cut".

Each prompt is answered by `dynamic`, by `dynamic:sliding=S` (the document prefilled first; every sliding layer
then keeps its S newest tokens, also while the question is read), and by `dynamic:sliding=S` with the sliding layers
of each `--whole` group (inclusive layer ranges, comma-separated) keeping their whole window. Printed per prompt:
each answer and whether it holds the reference; at the end, the answers kept per configuration (of those `dynamic`
gives).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import hf_kvcompress.caches.compressed as compressed
import hf_kvcompress.caches.padding as padding
from hf_kvcompress import load_model, make_cache, use_kvcompress_attention
from hf_kvcompress.caches.plan import sliding_layer_policy
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, prefill


def layer_set(text: str) -> set[int]:
    """'0-4,9' -> {0, 1, 2, 3, 4, 9}."""
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--sliding", type=int, default=16)
    parser.add_argument("--whole", nargs="+", default=["0-4", "6-10", "12-16"])
    args = parser.parse_args()
    model, tok = load_model(args.model)
    planned = compressed.plan_layers
    whole: set[int] = set()

    def with_whole_windows(*positional, **named):
        plans = planned(*positional, **named)
        # kept = window - 1: what transformers keeps, as an exact window under the layer's own mask (the other
        # sliding layers' count sets the mask transformers shares among them)
        return [dataclasses.replace(p, policy=sliding_layer_policy(p.codec, p.window, p.window - 1))
                if p.is_sliding and p.index in whole and p.window is not None else p for p in plans]

    compressed.plan_layers = with_whole_windows  # the cache's own call: the module's name is looked up at call time
    # Sliding layers keeping different counts cannot share transformers' one sliding mask: every layer builds its
    # own (causal, within its window), read by the package's attention function.
    padding.RowPadding.misplaces_shared_mask = lambda self, *args, **kwargs: True  # type: ignore[method-assign]
    use_kvcompress_attention(model)
    rows = [dict(r) for r in build_samples(tok, [args.task], [2000], args.depths, samples_per_cell=args.samples,
                                           split=args.split)]  # fmt: skip
    configs = [("dynamic", "dynamic", ""), (f"sliding={args.sliding}", f"dynamic:sliding={args.sliding}", "")]
    configs += [(f"sliding={args.sliding}, whole {g}", f"dynamic:sliding={args.sliding}", g) for g in args.whole]
    kept = {name: 0 for name, _, _ in configs}
    for row in rows:
        doc, question = encode(tok, row)
        reference = row["references"][0]
        for name, spec, group in configs:
            whole.clear()
            whole.update(layer_set(group) if group else set())
            cache = make_cache(spec, model.config)
            if name != "dynamic":  # the document first, as the eval compresses it: the question sees the cut
                prefill(model, torch.tensor([doc]), None, cache)
            result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=row["max_new_tokens"])
            text = tok.decode(result.new_tokens[0], skip_special_tokens=True)
            ok = reference in text
            print(f"{row['sample_id']} {name}: {ok} {text[:24]!r} (reference {reference})", flush=True)
            if name == "dynamic" and not ok:
                break  # only the answers the uncompressed cache gives count
            kept[name] += ok
    print("\nanswers kept (of dynamic's): " + "; ".join(f"{name} {n}" for name, n in kept.items()))


if __name__ == "__main__":
    main()
