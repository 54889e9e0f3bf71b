"""What the encoded store's room costs in bytes: its spare token slots as a share of the cache's bytes.

Question: the encoded store holds spare token slots so that a decode step writes its newly encoded tokens in place
(caches/encoded_room.py); how many bytes do they cost at 2k, 4k and 8k tokens, at the most (just after the room
grew; about half that on average over the steps until it grows again)?
Command:
    python benchmarks/probes/encoded_room_bytes.py --specs "int4;int2;fp8;lowrank:ratio=0.5;lowrank" \\
        --lengths 2048,4096,8192
Written up: docs/speed.md, "The encoded store grows in place (issues 29 and 30, session 29)".

No model runs: each layer of a cache built for the model's config (SmolLM2 by default) takes random states of
`length` tokens as a prompt, then single-token decode steps until its room has grown. The bytes are the cache's
promised bytes in bfloat16 (`promised_kv_bytes(torch.bfloat16)`, the served width), which `measured_kv_bytes`
equals (tests/caches/test_encoded_room.py); the share is the spare slots' bytes over the whole cache's (exact tail,
sinks and layers that encode nothing included).
"""

from __future__ import annotations

import argparse

import torch

from hf_kvcompress import make_cache
from hf_kvcompress.models import load_config


def _step(cache, config, states_at, position: int, tokens: int) -> None:
    for layer_idx in range(config.num_hidden_layers):
        keys, values = states_at(layer_idx, tokens)
        positions = torch.arange(position, position + tokens)[None]
        cache.update(keys, values, layer_idx, {"position_ids": positions})


def spare_share(spec: str, config, length: int) -> float:
    """The share of the cache's bf16 bytes held by spare slots just after the room grew (its largest: they are then
    used one block of tokens per step until the room grows again, so over a room's life they hold about half)."""
    generator = torch.Generator().manual_seed(0)
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def states_at(layer_idx: int, tokens: int):
        return (torch.randn(1, heads, tokens, dim, generator=generator),
                torch.randn(1, heads, tokens, dim, generator=generator))

    cache = make_cache(spec, config)
    _step(cache, config, states_at, 0, length)
    position = length
    # The first room grows when the first tokens past the prompt's are encoded: a step for per-token codecs, a key
    # group of steps for per-channel int4 keys.
    while not any(getattr(layer.store, "encoded_slots", 0) > layer.n_encoded for layer in cache.layers):
        if position >= length + 256:
            return 0.0  # nothing encoded at decode steps (a lossless store)
        _step(cache, config, states_at, position, 1)
        position += 1
    spare = sum((layer.store.encoded_slots - layer.n_encoded) * _token_bytes(layer) for layer in cache.layers
                if getattr(layer.store, "encoded_slots", 0))
    return spare / cache.promised_kv_bytes(torch.bfloat16)


def _token_bytes(layer) -> float:
    """bf16 bytes of one encoded token of the layer, over its batch row's KV heads."""
    codec = layer.codec
    return layer.kv_heads * (codec.bytes_per_token(layer.head_dim, "key", torch.bfloat16)
                             + codec.bytes_per_token(layer.value_dim, "value", torch.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path (its config only)")
    parser.add_argument("--specs", default="int4;int2;fp8;lowrank:ratio=0.5;lowrank", help="specs separated by ';'")
    parser.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths, comma-separated")
    args = parser.parse_args()
    config = load_config(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    print("| spec | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for spec in args.specs.split(";"):
        shares = [spare_share(spec, config, n) for n in lengths]
        print(f"| `{spec}` | " + " | ".join(f"{100 * share:.2f}%" for share in shares) + " |")


if __name__ == "__main__":
    main()
