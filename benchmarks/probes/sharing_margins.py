"""Which kind and which layers lose head sharing's multi_needle answers, read as answer margins.

Question: on the prompts that `shared_heads:ratio=R` loses (another needle's number answered), is it the predicted
keys (where attention lands) or the predicted values (what it reads there), and which layers? Each cache is the
same bytes: R of all layers' key and value heads stored; `keys` predicts only keys and `values` only values (the
same maps, the allocation's costs of the other kind made prohibitive in a copy of the maps file), and `exact
L0-L1` is the spec with layers L0..L1 stored exactly (fewer bytes saved; it says where the loss comes from).
Command:
    python benchmarks/probes/sharing_margins.py --ratio 0.67 --task multi_needle --split dev --samples 4 \\
        --work DIR [--maps MAPS] [--kinds] [--groups 6] [--specs "SPEC;SPEC"]
Written up: docs/results.md, "Head sharing on multi_needle: what predicted heads lose, and costs measured end to
end (issue 30, session 37; helper i30h)".

The margin (answer_margin.py): the uncompressed answer teacher-forced through each cache after the document was
prefilled into it; the smallest log-probability gap between an answer token and the best other token over the
answer up to the reference. Negative: the answer flips. Only prompts the uncompressed cache answers are read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from answer_margin import margins_table  # noqa: E402

from hf_kvcompress import load_model, make_cache, use_kvcompress_attention  # noqa: E402
from hf_kvcompress.caches.layer import CompressedLayer  # noqa: E402
from hf_kvcompress.calibration import SHARING_FILE, load_sharing  # noqa: E402
from hf_kvcompress.codecs.identity import IdentityCodec  # noqa: E402
from hf_kvcompress.eval.tasks import build_samples  # noqa: E402
from hf_kvcompress.generation import repeat_prompt_ids  # noqa: E402

PROHIBITIVE = 1e6  # a level cost no calibrated level reaches: the allocation takes that kind last


def kind_only_maps(source: str | None, config, kind: str, out: Path) -> Path:
    """A copy of the maps at `source` (None: the shipped ones) whose other kind's levels cost PROHIBITIVE, so that a
    ratio predicts `kind` only while that kind has levels left; returns its directory."""
    tensors, metadata = load_sharing(source, config)
    other = "value" if kind == "key" else "key"
    changed = {name: (torch.tensor(PROHIBITIVE) if f".{other}." in name and name.endswith(".cost") else tensor)
               for name, tensor in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in changed.items()}, str(out / SHARING_FILE), metadata=metadata)
    return out


def with_exact_layers(spec: str, config, layers: range):
    """A cache for `spec` whose layers in `layers` store every state exactly."""
    cache = make_cache(spec, config)
    for i in layers:
        old = cache.layers[i]
        cache.layers[i] = CompressedLayer(old.policy, IdentityCodec(), old.is_sliding,
                                          attention_window=old.attention_window)
    return cache


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", default="10,50,90")
    parser.add_argument("--samples", type=int, default=4, help="samples per depth")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--ratio", type=float, default=0.67)
    parser.add_argument("--maps", default=None, help="the maps to read (default: the shipped ones)")
    parser.add_argument("--work", required=True, help="directory for the kind-only copies of the maps")
    parser.add_argument("--kinds", action="store_true", help="also the keys-only and values-only caches")
    parser.add_argument("--groups", type=int, default=0, help="layers made exact at a time (0: none)")
    parser.add_argument("--specs", default="", help="more cache specs, separated by ';'")
    parser.add_argument("--max-answer-tokens", type=int, default=16)
    parser.add_argument("--out", help="write one JSON line per sample here too")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    use_kvcompress_attention(model)
    prompt_ids = repeat_prompt_ids(tokenizer)
    maps = "" if args.maps is None else f",maps={args.maps}"
    spec = f"shared_heads:ratio={args.ratio}{maps}"
    caches = {"dynamic": lambda: make_cache("dynamic", model.config), spec: lambda: make_cache(spec, model.config)}
    if args.kinds:
        for kind in ("key", "value"):
            where = kind_only_maps(args.maps, model.config, kind, Path(args.work) / f"{kind}-only")
            only = f"shared_heads:ratio={args.ratio},maps={where}"
            caches[f"{kind}s only"] = lambda only=only: make_cache(only, model.config)
    layers = model.config.num_hidden_layers
    for start in range(0, layers if args.groups else 0, args.groups or 1):  # --groups 0: no exact rows
        group = range(start, min(layers, start + args.groups))
        caches[f"exact {group.start}-{group.stop - 1}"] = lambda group=group: with_exact_layers(
            spec, model.config, group)
    for extra in (s for s in args.specs.split(";") if s):
        caches[extra] = lambda extra=extra: make_cache(extra, model.config)

    depths = [float(d) for d in args.depths.split(",")]
    rows = build_samples(tokenizer, [args.task], [args.length], depths, samples_per_cell=args.samples,
                         split=args.split)
    margins_table(model, tokenizer, rows, caches, prompt_ids, args.max_answer_tokens, args.out,
                  f"{args.model}, {args.task} at {args.length} tokens ({args.split})")

if __name__ == "__main__":
    main()
