"""Where a cache's bytes go: a spec's measured bytes as a share of DynamicCache's, and one layer's split by part.

Question: `lowrank:ratio=0.5+int4` (issue 30's "about 1/8 of the bf16 bytes") holds more than an eighth: which
parts hold the rest (int4's codes and scales, the full-precision residual, the slots' positions, the sinks)?
Command:
    python benchmarks/probes/lowrank_int4_bytes.py [--model smollm2-135m] [--dtype bfloat16]
        [--lengths 2000 4000 8000] [--specs "lowrank:ratio=0.5+int4" "lowrank:ratio=0.5" int4] [--layer 5]
        [--parts]
Written up: docs/results.md, "Low rank at 2x + int4: where the bytes go" (issue 30, sessions 28, 33 and 34).

`--parts` also splits every layer's bytes together by kind of part (int4 codes, their scales and zero points, the
residual held as latents, the whole tail, positions, sinks), as shares of DynamicCache's bytes, at every length.

Random token ids (the bytes do not depend on the text) are prefilled with `model(...)` into `make_cache(spec,
model.config)` and into a DynamicCache; `measured_kv_bytes` of each. The split names each tensor a layer holds by
the attribute path that reaches it (what `measured_kv_bytes` walks), so it runs on any version of the library.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache, measured_kv_bytes


def _named_tensors(obj, path: str, seen: set[int]):
    """(attribute path, tensor) for every tensor reachable from `obj`, as `measured_kv_bytes` walks it."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_tensors(value, f"{path}[{key}]", seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{path}[{i}]", seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for key, value in vars(obj).items():
            yield from _named_tensors(value, f"{path}.{key}", seen)


def split(layer) -> dict[str, int]:
    """A layer's storage bytes by the attribute path holding them (each storage once)."""
    out: dict[str, int] = {}
    storages: set[int] = set()
    for path, tensor in _named_tensors(layer, "layer", set()):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages:
            continue
        storages.add(ptr)
        out[path] = out.get(path, 0) + tensor.untyped_storage().nbytes()
    return out


# A part's attribute path (`split`) -> the kind of bytes it holds, first match wins.
PART_KINDS = (("codes", "codes"), ("scale", "scales"), ("zero", "scales"), ("_held", "held latents"),
              ("_tail", "whole tail"), ("positions", "positions"), ("sink", "sinks"))


def parts_by_kind(cache) -> dict[str, int]:
    """Every layer's storage bytes summed by kind of part (PART_KINDS; anything else is "other")."""
    out: dict[str, int] = {}
    for layer in cache.layers:
        for path, nbytes in split(layer).items():
            kind = next((k for key, k in PART_KINDS if key in path), "other")
            out[kind] = out.get(kind, 0) + nbytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--specs", nargs="+", default=["lowrank:ratio=0.5+int4", "lowrank:ratio=0.5", "int4"])
    parser.add_argument("--layer", type=int, default=5, help="the layer whose bytes are split by part (at the "
                        "first length)")
    parser.add_argument("--parts", action="store_true", help="split every layer's bytes by kind of part too")
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cpu", dtype=args.dtype)
    print(f"model {args.model} {args.dtype}; shares of DynamicCache's measured bytes")
    print("| tokens | " + " | ".join(f"`{s}`" for s in args.specs) + " |")
    for length in args.lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, length),
                            generator=torch.Generator().manual_seed(length))
        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=reference)
        base = measured_kv_bytes(reference)
        shares, splits, kinds = [], {}, {}
        for spec in args.specs:
            cache = make_cache(spec, model.config)
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache)
            shares.append(measured_kv_bytes(cache) / base)
            splits[spec] = split(cache.layers[args.layer])
            if args.parts:
                kinds[spec] = parts_by_kind(cache)
            del cache
        print(f"| {length:,} | " + " | ".join(f"{s:.3f}" for s in shares) + " |", flush=True)
        for spec, parts in kinds.items():
            ordered = sorted(parts.items(), key=lambda p: -p[1])
            print(f"  all layers, `{spec}` at {length}: "
                  + ", ".join(f"{kind} {nbytes / base:.3f}" for kind, nbytes in ordered))
        if length == args.lengths[0]:
            layer_base = sum(split(reference.layers[args.layer]).values())
            for spec, parts in splits.items():
                print(f"  layer {args.layer}, `{spec}` at {length}: "
                      + ", ".join(f"{path.removeprefix('layer.')} {nbytes / layer_base:.3f}"
                                  for path, nbytes in sorted(parts.items(), key=lambda p: -p[1])))


if __name__ == "__main__":
    main()
