"""Head sharing's levels ranked by the attention-output error they cause, and a maps copy that spends a ratio by it.

Question: does a cost measured on the attention output (each level alone, as lowrank's error curves measure ranks)
rank head sharing's levels better than the least-squares residual? Per layer, kind and level: the relative error of
the layer's attention output after its output projection on held-out calibration text with that kind's predicted
heads read from the maps (as the codec decodes them, the first 4 tokens exact) and everything else exact. Writes a
copy of the maps whose residual costs are these errors, so that `shared_heads:ratio=R,maps=OUT,allocate=residual`
spends the ratio by them.
Command:
    python benchmarks/probes/sharing_output_errors.py --maps MAPS --out OUT [--model smollm2-135m]
Written up: docs/results.md, "Head sharing on multi_needle: what predicted heads lose, and costs measured end to
end (issue 30, session 37; helper i30h)".
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_kvcompress.calibration import (
    ERROR_QUERIES,
    SHARING_FILE,
    attention_captures,
    attention_weights,
    held_out_ids,
    load_sharing,
    output_error,
)
from hf_kvcompress.codecs.shared_heads import CALIBRATED_SINKS, kv_head_count
from hf_kvcompress.hf.compat import text_config
from hf_kvcompress.models import load_model
from hf_kvcompress.sharing_costs import KINDS, bound_maps, single_level


def level_output_errors(model, input_ids: torch.Tensor, maps: str | os.PathLike,
                        queries: int = ERROR_QUERIES) -> list[tuple[list[float], list[float]]]:
    """Per layer (key errors, value errors) at levels 1 .. H-1: the relative error of the layer's attention output
    after its output projection (`calibration.output_error`, the last `queries` queries of `input_ids` [1, T]) with
    that kind's predicted heads read from the maps at `maps` (as the codec decodes them; the first
    CALIBRATED_SINKS tokens exact) and everything else exact."""
    config = model.config
    layers = text_config(config).num_hidden_layers
    heads = kv_head_count(config)
    _, bound = bound_maps(maps, config)
    captures = attention_captures(model, input_ids, queries)
    errors: list[tuple[list[float], list[float]]] = []
    for layer, capture in enumerate(captures):
        keys, values = capture["keys"][None], capture["values"][None]  # [1, H, T, D]
        positions = torch.arange(keys.shape[2], dtype=torch.int32).expand(1, heads, -1)
        exact = attention_weights(capture, capture["keys"])
        pair: tuple[list[float], list[float]] = ([], [])
        for k, (kind, states) in enumerate(zip(KINDS, (keys, values), strict=True)):
            for level in range(1, heads):
                at = bound.with_levels(single_level(layers, layer, kind, level)).for_layer(layer)
                extra = {"positions": positions} if kind == "key" else {}
                rebuilt = at.decode(at.encode(states, kind, **extra), kind, torch.float32, **extra)[0]
                rebuilt[:, :CALIBRATED_SINKS] = states[0, :, :CALIBRATED_SINKS]
                read = (rebuilt, capture["values"]) if kind == "key" else (capture["keys"], rebuilt)
                pair[k].append(output_error(model, capture, read, layer, None if kind == "key" else exact))
        errors.append(pair)
    return errors


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--maps", required=True, help="a `calibrate --sharing` output (directory or file)")
    parser.add_argument("--out", required=True, help="directory for the maps copy with these errors as costs")
    parser.add_argument("--tokens", type=int, default=2048, help="the calibration tokens the maps were fitted on")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    errors = level_output_errors(model, held_out_ids(tokenizer, args.tokens), args.maps)
    print("layer  key errors (levels 1..)  |  value errors")
    for layer, (key, value) in enumerate(errors):
        print(f"{layer:5d}  " + " ".join(f"{e:.4f}" for e in key) + "  |  " + " ".join(f"{e:.4f}" for e in value))
    tensors, metadata = load_sharing(args.maps, model.config)
    for layer, pair in enumerate(errors):
        for kind, kind_errors in zip(KINDS, pair, strict=True):
            for level, error in enumerate(kind_errors, start=1):
                tensors[f"layers.{layer}.{kind}.{level}.cost"] = torch.tensor(error)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / SHARING_FILE), metadata=metadata)
    print(f"maps with output errors as their residual costs: {out / SHARING_FILE}")


if __name__ == "__main__":
    main()
