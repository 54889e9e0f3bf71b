"""Which layers and which kind (keys or values) lose the digits that low rank misreads on multi_needle.

Question: (issue 30) on Gemma-3's multi_needle, `lowrank:ratio=0.5` answers other needles' numbers or numbers that
are not in the document (`4229999` for 4229929). On the prompts it loses (and `dynamic` answers), does the answer
come back when the keys are exact and the values low rank, or the reverse; when the full-attention layers are
exact, or the sliding ones? And how large is the bases' reconstruction error on the document's digit tokens
against its other tokens, per layer and kind?
Command:
    python benchmarks/probes/lowrank_digit_loss.py --model gemma-3-270m --spec lowrank:ratio=0.5
        [--tasks multi_needle] [--split dev] [--depths 10 50 90] [--samples 4] [--only ID ...] [--bases DIR]
        [--variants WORD ...] [--no-variants] [--token-variants] [--doc-mean] [--tables NAME=K/V,...]
        [--compare SPEC ...] [--errors-only]
Written up: docs/results.md, "Low rank on Gemma-3's multi_needle: what loses the answers".

The variants are simulated on an uncompressed cache: the document is prefilled, then each layer's keys (RoPE undone,
projected, turned back) and values are replaced by what the joint bases rebuild at that layer's ranks (the spec's
own ranks, read from its cache; `calibration.joint_reconstruction`, the first 4 tokens exact as lowrank's sinks),
and the question is read and answered exactly on top. The spec's own answer (the codec, which also projects the
question's tokens unless a residual window keeps them) is printed beside the simulation at its ranks.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache
from hf_kvcompress.calibration import joint_reconstruction, load_bases
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, prefill
from hf_kvcompress.hf.compat import text_config


def spec_ranks(model, spec: str) -> list:
    """Each layer's (key rank, value rank) as the spec's cache stores them (`LowRankCodec.layer_ranks`)."""
    cache = make_cache(spec, model.config)
    codec = cache.layers[0].codec
    ranks = getattr(codec, "layer_ranks", None)
    if ranks is None:
        raise ValueError(f"{spec!r} is not a lowrank spec with joint bases")
    return [tuple(pair) for pair in ranks]  # type: ignore[misc]


def reference_cache(model, doc: list[int]) -> DynamicCache:
    cache = DynamicCache()  # no config: every layer keeps every token (the model's mask applies the windows)
    prefill(model, torch.tensor([doc]), None, cache)
    return cache


def rebuilt_cache(model, reference: DynamicCache, tensors: dict, ranks: list, sinks: int = 4,
                  exact: dict[str, list[int]] | None = None, doc_mean: bool = False,
                  int_values: int | None = None) -> DynamicCache:
    """A copy of the document's cache `reference` with each layer's states as the joint bases rebuild them at
    `ranks` (the first `sinks` tokens exact; `exact`: per kind, token positions kept exact as well; `int_values`:
    the values stored in that many bits by `IntNCodec` instead, the keys at their ranks)."""
    cache = copy.deepcopy(reference)
    for i, layer in enumerate(cache.layers):
        if ranks[i] == (None, None):
            continue
        capture = {"keys": layer.keys[0].float(), "values": layer.values[0].float()}
        keys, values = joint_reconstruction(model.config, tensors, i, capture, ranks[i], sinks=sinks)
        if int_values:  # values stored by an int codec instead of the bases (per token, groups along the channels)
            codec = IntNCodec(bits=int_values)
            exact_values = capture["values"][None]
            values = codec.decode(codec.encode(exact_values, "value"), "value", torch.float32)[0]
            values = torch.cat([capture["values"][:, :sinks], values[:, sinks:]], 1)
        if doc_mean and ranks[i][1] is not None:  # the document's own mean of what the value basis leaves out
            values = values + (capture["values"] - values)[:, sinks:].mean(1, keepdim=True)
        for kind, rebuilt in (("key", keys), ("value", values)):
            at = (exact or {}).get(kind)
            if at:
                rebuilt[:, at] = capture[f"{kind}s"][:, at]
        layer.keys = keys[None].to(layer.keys.dtype)
        layer.values = values[None].to(layer.values.dtype)
    return cache


def answer_from(model, tok, row, doc, question, cache) -> tuple[str, bool]:
    result = generate(model, torch.tensor([doc + question]), None, cache, max_new_tokens=row["max_new_tokens"])
    text = tok.decode(result.new_tokens[0], skip_special_tokens=True)
    return text, all(ref in text for ref in row["references"])


def variants(ranks: list, layer_types: list[str]) -> dict[str, list]:
    """The rank tables tried on a lost prompt: one kind exact, one layer type exact, and their crossings."""
    full = [t != "sliding_attention" for t in layer_types]

    def where(test: Callable[[int], bool], key: bool, value: bool) -> list:
        return [(None if key and test(i) else k, None if value and test(i) else v) for i, (k, v) in enumerate(ranks)]

    every = lambda i: True  # noqa: E731
    return {
        "spec's ranks (simulated)": list(ranks),
        "keys exact, values low rank": where(every, True, False),
        "values exact, keys low rank": where(every, False, True),
        "full-attention layers exact": where(lambda i: full[i], True, True),
        "sliding layers exact": where(lambda i: not full[i], True, True),
        "full-attention keys exact": where(lambda i: full[i], True, False),
        "full-attention values exact": where(lambda i: full[i], False, True),
        "sliding keys exact": where(lambda i: not full[i], True, False),
        "sliding values exact": where(lambda i: not full[i], False, True),
    }


def digit_positions(tok, doc: list[int], references: list[str]) -> tuple[list[int], list[int]]:
    """(positions of the document's digit tokens, positions of the asked number's tokens)."""
    digits = [i for i, t in enumerate(doc) if tok.decode([t]).strip().isdigit()]
    asked = []
    for ref in references:
        ids = tok(ref, add_special_tokens=False).input_ids
        for i in range(len(doc) - len(ids) + 1):
            if doc[i: i + len(ids)] == ids:
                asked.extend(range(i, i + len(ids)))
    return digits, asked


def needle_positions(tok, doc: list[int]) -> list[int]:
    """Positions of every needle sentence's tokens ("The special magic number for ... is: N.")."""
    text_pieces = [tok.decode([t]) for t in doc]
    joined, starts = "", []
    for piece in text_pieces:
        starts.append(len(joined))
        joined += piece
    positions = []
    for match in re.finditer(r"The special magic number for [^.]*? is: \d+\.", joined):
        positions.extend(i for i, start in enumerate(starts) if match.start() <= start < match.end())
    return positions


def token_errors(model, tensors: dict, cache: DynamicCache, ranks: list, groups: dict[str, list[int]],
                 digits: list[int]) -> list[dict]:
    """Per layer and kind, the mean relative squared error ||x - x'||^2 / ||x||^2 of each group's tokens, and
    (`digit spread`) the digit tokens' mean squared error over their mean squared distance from the digits' mean
    state: how much of what tells one digit token from another the bases lose."""
    rows = []
    for i, layer in enumerate(cache.layers):
        capture = {"keys": layer.keys[0].float(), "values": layer.values[0].float()}
        keys, values = joint_reconstruction(model.config, tensors, i, capture, ranks[i])
        row = {}
        for kind, exact, rebuilt in (("key", capture["keys"], keys), ("value", capture["values"], values)):
            rel = (rebuilt - exact).pow(2).sum((0, 2)) / exact.pow(2).sum((0, 2)).clamp(min=1e-30)  # [T]
            row[kind] = {name: float(rel[idx].mean()) if idx else float("nan") for name, idx in groups.items()}
            if kind == "value":
                fixed = rebuilt + (exact - rebuilt)[:, 4:].mean(1, keepdim=True)
                rel_fixed = (fixed - exact).pow(2).sum((0, 2)) / exact.pow(2).sum((0, 2)).clamp(min=1e-30)
                row[kind]["with doc mean"] = float(rel_fixed[groups["other tokens"]].mean())
            at = exact[:, digits]
            spread = (at - at.mean(1, keepdim=True)).pow(2).sum((0, 2)).mean()
            row[kind]["digit spread"] = float((rebuilt - exact)[:, digits].pow(2).sum((0, 2)).mean() / spread)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--spec", default="lowrank:ratio=0.5")
    parser.add_argument("--bases", default=None, help="a calibrate output (default: the shipped bases)")
    parser.add_argument("--tasks", nargs="+", default=["multi_needle"])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="sample ids to run (default: all)")
    parser.add_argument("--errors-only", action="store_true", help="only the reconstruction errors")
    parser.add_argument("--compare", nargs="*", default=[],
                        help="other lowrank specs whose ranks (and bases) are simulated on the lost prompts too")
    parser.add_argument("--no-variants", action="store_true", help="skip the exact-kind and exact-layer variants")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="run only the variants whose names contain one of these words (default: all)")
    parser.add_argument("--skip-codec", action="store_true", help="do not answer through the spec's own cache")
    parser.add_argument("--int-values", type=int, nargs="*", default=[],
                        help="also: the values stored by int codecs of these bits (e.g. 4 8), keys at the spec's ranks")
    parser.add_argument("--doc-mean", action="store_true",
                        help="also: values rebuilt plus the document's own mean of what their basis leaves out")
    parser.add_argument("--token-variants", action="store_true",
                        help="also: more exact first tokens, and values exact at the needles' tokens only or "
                        "everywhere but there, or in the document's last 512 tokens")
    parser.add_argument("--tables", nargs="*", default=[],
                        help="NAME=K1/V1,K2/V2,...: rank tables simulated on the lost prompts with the spec's bases "
                        "(per layer key/value rank; x: that kind exact)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    spec = args.spec if args.bases is None else f"{args.spec},bases={args.bases}"
    tensors, _ = load_bases(args.bases, model.config)
    ranks = spec_ranks(model, spec)
    layer_types = list(getattr(text_config(model.config), "layer_types", None) or ["full_attention"] * len(ranks))
    print(f"{spec}: (key, value) ranks per layer {ranks}", flush=True)
    rows = [dict(r) for r in build_samples(tok, args.tasks, [2000], args.depths, samples_per_cell=args.samples,
                                           split=args.split)]  # fmt: skip
    for row in rows:
        if args.only and row["sample_id"] not in args.only:
            continue
        doc, question = encode(tok, row)
        digits, asked = digit_positions(tok, doc, row["references"])
        others = sorted(set(range(4, len(doc))) - set(digits))
        groups = {"asked number": asked, "other digits": sorted(set(digits) - set(asked)), "other tokens": others}
        reference = reference_cache(model, doc)
        errors = token_errors(model, tensors, reference, ranks, groups, digits)
        print(f"{row['sample_id']}: references {row['references']}; relative error (asked number / other digits / "
              f"other tokens; digit spread) per layer, keys | values:")
        for i, err in enumerate(errors):
            cells = [" / ".join(f"{err[kind][g]:.3f}" for g in groups) + f"; {err[kind]['digit spread']:.3f}"
                     for kind in ("key", "value")]
            cells[1] += f"; other tokens with the document's mean {err['value']['with doc mean']:.3f}"
            print(f"  layer {i:2d} {layer_types[i][:4]}: {cells[0]}  |  {cells[1]}")
        if args.errors_only:
            continue
        right = True  # with --skip-codec: the codec's answer is not read, and no lost-prompt variant runs
        if not args.skip_codec:
            text, right = answer_from(model, tok, row, doc, question, make_cache(spec, model.config))
            print(f"  {spec}: correct={right} {text!r}", flush=True)
        said, dyn = answer_from(model, tok, row, doc, question, copy.deepcopy(reference))
        print(f"  dynamic: correct={dyn} {said!r}", flush=True)
        if not dyn:
            continue
        tables = {} if args.no_variants or right else variants(ranks, layer_types)
        if args.variants:
            tables = {name: table for name, table in tables.items() if any(v in name for v in args.variants)}
        for name, table in tables.items():
            text, ok = answer_from(model, tok, row, doc, question, rebuilt_cache(model, reference, tensors, table))
            print(f"  {name}: correct={ok} {text!r}", flush=True)
        for bits in args.int_values:
            cache = rebuilt_cache(model, reference, tensors, ranks, int_values=bits)
            text, ok = answer_from(model, tok, row, doc, question, cache)
            print(f"  keys at the spec's ranks, values in int{bits}: correct={ok} {text!r}", flush=True)
        if args.doc_mean:
            text, ok = answer_from(model, tok, row, doc, question,
                                   rebuilt_cache(model, reference, tensors, ranks, doc_mean=True))
            print(f"  values with the document's residual mean: correct={ok} {text!r}", flush=True)
        if args.token_variants:
            needles = needle_positions(tok, doc)
            rest = sorted(set(range(len(doc))) - set(needles))
            newest = list(range(max(0, len(doc) - 512), len(doc)))
            token_tables: list[tuple[str, int, dict[str, list[int]] | None]] = [
                ("first 64 tokens exact", 64, None),
                ("values exact at the needle sentences", 4, {"value": needles}),
                ("values exact but at the needle sentences", 4, {"value": rest}),
                ("both kinds exact at the needle sentences", 4, {"key": needles, "value": needles}),
                ("values exact in the last 512 tokens", 4, {"value": newest}),
            ]
            for name, sinks, exact in token_tables:
                cache = rebuilt_cache(model, reference, tensors, ranks, sinks, exact)
                text, ok = answer_from(model, tok, row, doc, question, cache)
                print(f"  {name}: correct={ok} {text!r}", flush=True)
        for named in args.tables:
            name, cells = named.split("=", 1)
            table = [tuple(None if r == "x" else int(r) for r in cell.split("/")) for cell in cells.split(",")]
            cache = rebuilt_cache(model, reference, tensors, table)
            text, ok = answer_from(model, tok, row, doc, question, cache)
            print(f"  table {name} (simulated): correct={ok} {text!r}", flush=True)
        for other in args.compare:
            bases = dict(part.split("=", 1) for part in other.split(":", 1)[1].split(",") if "=" in part).get("bases")
            other_tensors = load_bases(bases, model.config)[0]
            cache = rebuilt_cache(model, reference, other_tensors, spec_ranks(model, other))
            text, ok = answer_from(model, tok, row, doc, question, cache)
            print(f"  {other} (simulated): correct={ok} {text!r}", flush=True)


if __name__ == "__main__":
    main()
