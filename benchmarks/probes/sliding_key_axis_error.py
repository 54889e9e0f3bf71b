"""Sliding-window layers: windowed attention error with keys grouped per token against keys grouped per channel.

Question: in the sliding-window layers, how much smaller is the attention error with keys grouped per channel than
per token, at each width?
Command:
    python benchmarks/probes/sliding_key_axis_error.py --model gemma-3-270m --task multi_needle --length 2000 \\
        --depths 0,25,50,75 --configs "bits=4;bits=3;bits=2,codebook=gaussian,pre_rope=true"
Written up: docs/methods.md, "Sliding-window layers (Gemma 3)", and docs/results.md, "The suite: retention at each
width".

Before 0.3.0 a sliding layer stored its keys per token (an exact window must drop single tokens); since then it keeps
per-channel key groups under a window that drops whole groups (policies/block_window.py). This measures what that
changes where it matters, in the sliding layers only: the relative error of each sliding layer's attention output
for the prompt's last (question) tokens over its window, with each config's keys quantized per token and per
channel (the rest of the config as given, plus the plain names' rotate=auto and 4 sinks), averaged over layers and
prompts. The recording and storing helpers are quant_attention_error.py's.
"""

from __future__ import annotations

import argparse

import torch
from quant_attention_error import (
    AttentionInterface,
    AttentionMaskInterface,
    IntNCodec,
    as_stored,
    attend,
    build_samples,
    encode,
    load_model,
    parse_value,
    recording_attention,
    sdpa_mask,
)

from hf_kvcompress.caches.plan import plan_layers
from hf_kvcompress.codecs.base import resolve_for_model
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.policies.keep_all import KeepAllPolicy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", default="0,25,50,75")
    parser.add_argument("--configs", default="bits=4;bits=3;bits=2;bits=2,codebook=gaussian,pre_rope=true",
                        help="IntNCodec keyword sets separated by ';' (key_axis is set by the script)")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    # the sliding_attention layers and their windows, as the cache plans them
    windows = {p.index: p.attention_window for p in plan_layers(KeepAllPolicy(), IdentityCodec(), model.config)
               if p.attention_window is not None}  # fmt: skip
    if not windows:
        parser.error(f"--model {args.model} has no sliding-window layers")
    configs = [c for c in args.configs.split(";") if c]
    errors: dict[tuple[str, str], list[float]] = {}
    samples = build_samples(tokenizer, [args.task], [args.length], [float(d) for d in args.depths.split(",")])
    for sample in samples:
        document, question = encode(tokenizer, sample)
        store: dict = {}
        AttentionInterface.register("record_sdpa", recording_attention(store, len(question)))
        AttentionMaskInterface.register("record_sdpa", sdpa_mask)
        model.set_attn_implementation("record_sdpa")
        with torch.no_grad():
            model(input_ids=torch.tensor([document + question]))
        for config in configs:
            kwargs = {"rotate": "auto", "sink_tokens": 4}
            kwargs.update({k: parse_value(v) for k, v in (p.split("=") for p in config.split(","))})
            for axis in ("token", "channel"):
                codec = resolve_for_model(IntNCodec(**kwargs, key_axis=axis), model.config)
                per_layer = []
                for i, window in windows.items():
                    query, key, value, scaling = store[i]
                    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
                    layer_codec = codec.for_layer(i)
                    ref, _ = attend(query, key, value, scaling, window)
                    out, _ = attend(query, as_stored(key, layer_codec, "key"), as_stored(value, layer_codec, "value"),
                                     scaling, window)  # fmt: skip
                    per_layer.append(((out - ref).norm() / ref.norm()).item())
                errors.setdefault((config, axis), []).append(sum(per_layer) / len(per_layer))
    print(f"{args.model}, {args.task} at {args.length} tokens, depths {args.depths}; {len(windows)} sliding layers")
    print(f"{'config':50s} {'keys per token':>15s} {'keys per channel':>17s}")
    for config in configs:
        token, channel = (sum(errors[config, a]) / len(errors[config, a]) for a in ("token", "channel"))
        print(f"{config:50s} {token:15.4f} {channel:17.4f}")


if __name__ == "__main__":
    main()
