"""How much each integer-codec option disturbs attention on real keys, values and queries (a fast proxy for the suite).

Question: for each integer-codec configuration, how far is the attention output from the uncompressed one, and how
much of the attention on the needle remains (per layer with --per-layer, which picks `wide_layers`)?
Command:
    python benchmarks/probes/quant_attention_error.py [--model smollm2-135m] [--length 2000] [--depths 0,50]
        [--configs "bits=2,rotate=hadamard,key_axis=channel,sink_tokens=4;bits=2,...,pre_rope=true"] [--per-layer]
        [--split test|dev]
Written up: docs/results.md, "Quantization options, and what each one measured" (its introduction and "The suite:
retention at each width"), "Where each family fits (from the measurements above)" and "What int4 changes under
eviction on Gemma-3: per-token keys" (key_smooth).

One needle prompt per depth (the suite's own samples, question after the document) runs once through the model with
an uncompressed cache while an attention function records every layer's queries, keys and values (sliding-window
layers attend over their window and store keys per token, as the cache stores them).
Each codec configuration then stores the keys and values as the cache would (the first `sink_tokens` tokens exact,
the newest `residual_length` tokens exact, the rest encoded and decoded), and the question's queries attend over
them. Printed: the relative error of the attention output, mean over layers and prompts, and the attention mass on
the needle's tokens as a share of the uncompressed mass (1.00 = unchanged).

Three keys in a configuration are not codec options: `key_outliers=N` and `value_outliers=N` keep each token's N
largest-magnitude key (value) entries exact and encode the rest (dense-and-sparse, KVQuant arXiv:2401.18079), to
see whether outliers would pay for their bytes (each costs a bfloat16 value and a one-byte index). `key_smooth=prompt`
centres each key channel on its mean and divides it by its standard deviation over the encoded tokens (per row and
KV head) before the codec encodes the keys, and undoes it after decoding (the statistics kept exact: two head_dim
vectors per head); `key_smooth=calibration` takes those statistics from the calibration text's keys instead (what a
model could ship): whether per-token key groups (evicting policies) can reach per-channel groups' error.
`key_stat=absmax|rms|p99` divides each channel by that statistic of its magnitudes instead (no centring: what a
codec can fold into the query), and `key_smooth_after=true` normalises the keys after the codec's rotation.
`--per-layer` prints each layer's error too.

`--text calibration` measures on the package's calibration text (HotpotQA paragraphs, `hf_kvcompress.calibration`)
instead of the needle prompts, with the last 32 tokens as the queries: the layers chosen for `wide_layers` on the
suite's own prompts can be checked there on text the suite never grades (no needle mass then).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_kvcompress import load_model
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.caches.plan import plan_layers
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.codecs.intn import IntNCodec
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.policies.keep_all import KeepAllPolicy
from hf_kvcompress.registry import parse_value

CONFIGS = [
    f"bits={b},rotate={r},key_axis={a},sink_tokens={s}"
    for b in (4, 3, 2) for r in ("none", "hadamard") for a in ("channel", "token") for s in (0, 4)
]


def recording_attention(store: dict, question: int):
    def attention(module, query, key, value, attention_mask, **kwargs):
        store[module.layer_idx] = (query[:, :, -question:].float(), key.float(), value.float(), kwargs.get("scaling"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def _split_outliers(states, count: int):
    """(dense, sparse): each token's `count` largest-magnitude entries moved into the sparse part."""
    if count == 0:
        return states, torch.zeros_like(states)
    index = states.abs().topk(count, dim=-1).indices
    sparse = torch.zeros_like(states).scatter(-1, index, states.gather(-1, index))
    return states - sparse, sparse


KEY_STATS = ("meanstd", "absmax", "rms", "p99")


def channel_stats(states, stat: str = "meanstd"):
    """(offset, spread) of each key channel over the tokens, [B, H, 1, D] each (`key_smooth`): `meanstd` centres on
    the mean and divides by the standard deviation; the others divide only (offset 0) by the channel's largest
    magnitude, its root mean square, or the 99th percentile of its magnitudes."""
    if stat == "meanstd":
        return states.mean(2, keepdim=True), states.std(2, keepdim=True).clamp(min=1e-6)
    magnitude = states.abs()
    if stat == "absmax":
        spread = magnitude.amax(2, keepdim=True)
    elif stat == "rms":
        spread = magnitude.pow(2).mean(2, keepdim=True).sqrt()
    elif stat == "p99":
        spread = magnitude.quantile(0.99, dim=2, keepdim=True)
    else:
        raise ValueError(f"key_stat must be one of {KEY_STATS}, got {stat!r}")
    return torch.zeros_like(spread), spread.clamp(min=1e-6)


def as_stored(states, codec: IntNCodec, kind: str, outliers: int = 0, smooth=None, stat: str = "meanstd",
              after: bool = False):
    """The states as the cache holds them after prefill: exact sinks and residual, the middle encoded. `smooth`:
    "prompt" or an (offset, spread) pair, the channel statistics the encoded states are normalised by (`stat`, for
    "prompt"). `after`: normalise the rotated keys (the codec's rotation applied here, then off), not the raw ones."""
    if after and smooth is not None:
        # the codec's own rotation (to_basis: the identity where it does not rotate), then the codec without one
        unrotated = replace(codec, rotate="none")
        rotated = as_stored(codec.to_basis(states, kind), unrotated, kind, outliers, smooth, stat)
        out = codec.from_basis(rotated, kind)
        out[:, :, : codec.sink_tokens] = states[:, :, : codec.sink_tokens]
        return out
    t = states.shape[2]
    encoded = max(0, (t - codec.residual_length) // codec.group_size * codec.group_size)
    if encoded == 0:
        return states
    out = states.clone()
    dense, sparse = _split_outliers(states[:, :, :encoded], outliers)
    if smooth is None:
        out[:, :, :encoded] = codec.decode(codec.encode(dense, kind), kind, states.dtype) + sparse
    else:
        mean, spread = channel_stats(dense, stat) if smooth == "prompt" else smooth
        normalised = (dense - mean) / spread
        out[:, :, :encoded] = codec.decode(codec.encode(normalised, kind), kind, states.dtype) * spread + mean + sparse
    out[:, :, : codec.sink_tokens] = states[:, :, : codec.sink_tokens]
    return out


def attend(query, key, value, scaling, window=None):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ key.transpose(-1, -2) * scaling
    q_len, kv_len = query.shape[2], key.shape[2]
    distance = torch.arange(kv_len - q_len, kv_len)[:, None] - torch.arange(kv_len)[None, :]
    allowed = (distance >= 0) & (distance < (window or kv_len + 1))
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs @ value, probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", default="0,50")
    parser.add_argument("--configs", default=";".join(CONFIGS),
                        help="IntNCodec keyword sets separated by ';' (default: bits x rotate x key_axis x sinks)")
    parser.add_argument("--per-layer", action="store_true", help="also print each layer's error")
    parser.add_argument("--split", choices=("dev", "test"), default="test",
                        help="the suite's half the needle prompts come from (dev: for choosing options)")
    parser.add_argument("--text", choices=("needle", "calibration"), default="needle",
                        help="needle: the suite's prompts; calibration: HotpotQA paragraphs the suite never grades")
    args = parser.parse_args()
    configs = args.configs.split(";")
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    plans = plan_layers(KeepAllPolicy(), IdentityCodec(), model.config)
    # Sliding-window layers (Gemma-3) attend over their window, as the cache plans them.
    layers = list(range(len(plans)))
    windows = {p.index: p.attention_window for p in plans if p.attention_window is not None}
    depths = [float(d) for d in args.depths.split(",")]
    samples = (build_samples(tokenizer, ["needle"], [args.length], depths, split=args.split) if args.text == "needle"
               else [None])
    calibration_keys = {}  # layer -> the calibration text's keys (key_smooth=calibration)
    if any("key_smooth=calibration" in c for c in configs):
        from hf_kvcompress.calibration import calibration_text

        text_ids = tokenizer(calibration_text(words=args.length * 2))["input_ids"][: args.length]
        store_calibration: dict = {}
        AttentionInterface.register("record_sdpa", recording_attention(store_calibration, 1))
        AttentionMaskInterface.register("record_sdpa", sdpa_mask)
        model.set_attn_implementation("record_sdpa")
        with torch.no_grad():
            model(input_ids=torch.tensor([text_ids]))
        calibration_keys = {i: store_calibration[i][1][:, :, 4:] for i in layers}  # past the sinks
    totals = {c: [0.0, 0.0] for c in configs}
    per_layer = {c: torch.zeros(len(layers)) for c in configs}
    for sample in samples:
        if sample is None:
            from hf_kvcompress.calibration import calibration_text

            text_ids = tokenizer(calibration_text(words=args.length * 2))["input_ids"][: args.length]
            document, question = text_ids[:-32], text_ids[-32:]
            needle_slots = None
        else:
            document, question = encode(tokenizer, sample)
            needle_ids = tokenizer(" " + sample["references"][0], add_special_tokens=False)["input_ids"]
            needle = next(i for i in range(len(document)) if document[i : i + len(needle_ids)] == needle_ids)
            needle_slots = slice(needle, needle + len(needle_ids))
        ids = torch.tensor([document + question])
        store: dict = {}
        AttentionInterface.register("record_sdpa", recording_attention(store, len(question)))
        AttentionMaskInterface.register("record_sdpa", sdpa_mask)
        model.set_attn_implementation("record_sdpa")
        with torch.no_grad():
            model(input_ids=ids)
        for config in configs:
            kwargs = {k: parse_value(v) for k, v in (p.split("=") for p in config.split(","))}
            key_outliers, value_outliers = kwargs.pop("key_outliers", 0), kwargs.pop("value_outliers", 0)
            smooth = kwargs.pop("key_smooth", None)
            stat, after = kwargs.pop("key_stat", "meanstd"), kwargs.pop("key_smooth_after", False)
            if smooth not in (None, "prompt", "calibration"):
                raise ValueError(f"key_smooth must be prompt or calibration, got {smooth!r}")
            # Each layer's codec as the cache builds it: bound to the model (RoPE frequencies, rotate=auto), keys
            # per token in sliding-window layers.
            built = CompressedCache(codec=IntNCodec(**kwargs), config=model.config)
            layer_codecs = [layer.codec for layer in built.layers]
            errors, mass = [], []
            for i in layers:
                query, key, value, scaling = store[i]
                scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
                layered = layer_codecs[i]
                window = windows.get(i)
                ref, ref_probs = attend(query, key, value, scaling, window)
                stats = smooth
                if smooth == "calibration":
                    keys = calibration_keys[i]
                    if after:
                        keys = layered.to_basis(keys, "key")
                    stats = channel_stats(keys, stat)
                stored = as_stored(key, layered, "key", key_outliers, stats, stat, after)
                out, probs = attend(query, stored,
                                     as_stored(value, layered, "value", value_outliers), scaling, window)
                errors.append(((out - ref).norm() / ref.norm()).item())
                if needle_slots is not None and ref_probs[..., needle_slots].sum() > 0:  # within this layer's reach
                    mass.append((probs[..., needle_slots].sum() / ref_probs[..., needle_slots].sum()).item())
            per_layer[config] += torch.tensor(errors) / len(samples)
            totals[config][0] += sum(errors) / len(errors) / len(samples)
            totals[config][1] += sum(mass) / len(mass) / len(samples) if mass else float("nan")
    where = f"needle at {args.length} tokens, depths {args.depths}, {args.split} half" if args.text == "needle" else \
        f"calibration text, {args.length} tokens, last 32 as queries"
    print(f"{args.model}, {where}; {len(layers)} layers, {len(windows)} of them sliding-window")
    print(f"{'codec':50s} {'attn out rel. err':>18s} {'needle mass':>12s}")
    for config, (error, mass) in totals.items():
        print(f"{config:50s} {error:18.4f} {mass:12.3f}")
        if args.per_layer:
            errors = zip(layers, per_layer[config].tolist(), strict=False)
            print("  per layer: " + " ".join(f"{i}:{e:.3f}" for i, e in errors))
            ranked = per_layer[config].argsort(descending=True).tolist()
            print("  worst first: " + "/".join(str(layers[i]) for i in ranked))


if __name__ == "__main__":
    main()
