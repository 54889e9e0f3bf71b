"""Where a cache's bytes go: a spec's measured bytes as a share of DynamicCache's, and one layer's split by part.

Question: `lowrank:ratio=0.5+int4` (issue 30's "about 1/8 of the bf16 bytes") holds more than an eighth: which
parts hold the rest (int4's codes and scales, the full-precision residual, the slots' positions, the sinks)?
Command:
    python benchmarks/probes/lowrank_int4_bytes.py [--model smollm2-135m] [--dtype bfloat16]
        [--lengths 2000 4000 8000] [--specs "lowrank:ratio=0.5+int4" "lowrank:ratio=0.5" int4] [--layer 5]
        [--parts]
Written up: docs/results.md, "Low rank at 2x + int4: where the bytes go" (issue 30, sessions 28, 33 and 34).

`--parts` also splits every layer's bytes together by kind of part (int4 codes, their scales and zero points, the
residual held as latents, the whole tail, positions, sinks), as shares of DynamicCache's bytes, at every length; on
a model with sliding-window layers also per kind of layer (sliding, full attention).

On a model with sliding-window layers (Gemma-3) the DynamicCache prefilled by one forward still holds every prompt
token in its sliding layers, while the eval's uncompressed cache (and a decode step's) holds their windows: each
share is then printed twice, the second (in brackets) against the bf16 bytes of what the uncompressed cache holds
(`held_reference_bytes`: min(tokens, window) in sliding layers), which is the eval's reference.

Random token ids (the bytes do not depend on the text) are prefilled with `model(...)` into `make_cache(spec,
model.config)` and into a DynamicCache; `measured_kv_bytes` of each. The split names each tensor a layer holds by
the attribute path that reaches it (what `measured_kv_bytes` walks), so it runs on any version of the library.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from hf_kvcompress import load_model, make_cache, measured_kv_bytes
from hf_kvcompress.budget import kv_bytes_from_config


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


def held_reference_bytes(config, tokens: int, element_bytes: int = 2) -> int | None:
    """Bytes an uncompressed cache holds after `tokens` prompt tokens, sliding layers their window only (the budget
    calculator's count, `kv_bytes_from_config`); None on a model without sliding-window layers (the measured
    DynamicCache is then the reference as it is)."""
    text = getattr(config, "text_config", None) or config
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return None
    return int(kv_bytes_from_config(config, tokens, bytes_per_value=element_bytes))


def parts_by_kind(cache, layers=None) -> dict[str, int]:
    """Every layer's (or those in `layers`') storage bytes summed by kind of part (PART_KINDS; anything else is
    "other")."""
    out: dict[str, int] = {}
    for i, layer in enumerate(cache.layers):
        if layers is not None and i not in layers:
            continue
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
    text = getattr(model.config, "text_config", None) or model.config
    kinds_of_layers = getattr(text, "layer_types", None) or []
    by_type = {kind: {i for i, k in enumerate(kinds_of_layers) if k == kind} for kind in set(kinds_of_layers)}
    print(f"model {args.model} {args.dtype}; shares of DynamicCache's measured bytes")
    print("| tokens | " + " | ".join(f"`{s}`" for s in args.specs) + " |")
    for length in args.lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, length),
                            generator=torch.Generator().manual_seed(length))
        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=reference)
        base = measured_kv_bytes(reference)
        held = held_reference_bytes(model.config, length)
        shares, splits, kinds, typed = [], {}, {}, {}
        for spec in args.specs:
            cache = make_cache(spec, model.config)
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache)
            shares.append(measured_kv_bytes(cache))
            splits[spec] = split(cache.layers[args.layer])
            if args.parts:
                kinds[spec] = parts_by_kind(cache)
                if held is not None:
                    typed[spec] = {kind: parts_by_kind(cache, layers) for kind, layers in sorted(by_type.items())}
            del cache
        print(f"| {length:,} | " + " | ".join(f"{s / base:.3f}" + ("" if held is None else f" ({s / held:.3f})")
                                             for s in shares) + " |", flush=True)
        for spec, parts in kinds.items():
            ordered = sorted(parts.items(), key=lambda p: -p[1])
            print(f"  all layers, `{spec}` at {length}: "
                  + ", ".join(f"{kind} {nbytes / base:.3f}" for kind, nbytes in ordered))
            for layer_kind, layer_parts in typed.get(spec, {}).items():
                ordered = sorted(layer_parts.items(), key=lambda p: -p[1])
                assert held is not None
                print(f"    {layer_kind} layers ({len(by_type[layer_kind])}), shares of the held reference: "
                      + ", ".join(f"{kind} {nbytes / held:.3f}" for kind, nbytes in ordered))
        if length == args.lengths[0]:
            layer_base = sum(split(reference.layers[args.layer]).values())
            for spec, parts in splits.items():
                print(f"  layer {args.layer}, `{spec}` at {length}: "
                      + ", ".join(f"{path.removeprefix('layer.')} {nbytes / layer_base:.3f}"
                                  for path, nbytes in sorted(parts.items(), key=lambda p: -p[1])))


if __name__ == "__main__":
    main()
