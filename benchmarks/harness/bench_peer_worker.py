"""One bench run of a peer (transformers' QuantizedCache, a kvpress press) or of DynamicCache, in the peer's own
environment.

    python benchmarks/harness/bench_peer_worker.py --peer quanto-int4 --model-dir DIR --length 1024 --batch 1 \\
        --new-tokens 16 --clock cpu

Runs in a virtual environment of its own (peer_envs.py): kvpress pins transformers < 5.3, and optimum-quanto and hqq
are no dependencies of hf_kvcompress. So it imports torch, transformers, the peer's library and bench_measure.py,
never hf_kvcompress, and measures what bench.py's worker measures, the same way: the model from DIR (the folder our
loader converted the embedded model to) in float32, the same random prompt, one warm-up forward, then one prefill
and `new_tokens` greedy decode steps on the chosen clock, peak resident memory above the level before prefill, and
the bytes of tensor storage the cache holds after decoding. `--peer dynamic` is DynamicCache in this environment:
the baseline its peers are compared with. Prints one JSON line.

A kvpress press compresses the prompt as kvpress's pipeline does: the press's hooks are on during the prefill (KVzip
then replays the context to score it: that is part of its prefill), and decoding continues at the positions after
the whole prompt. Its head-wise presses (KVzip) mask evicted keys and free nothing, so their bytes stay DynamicCache's.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json

KEEP = 0.25  # share of the prompt kvpress keeps: kvzip:ratio=0.25's, and the 1,024-token budgets' at 4k tokens
PEERS = {  # name -> (environment, settings): QuantizedCache's keyword arguments, or a kvpress press
    "quanto-int4": ("quantized", {"backend": "quanto", "nbits": 4}),
    "quanto-int2": ("quantized", {"backend": "quanto", "nbits": 2}),
    "hqq-int4": ("quantized", {"backend": "hqq", "nbits": 4, "axis_key": 1, "axis_value": 1}),
    "hqq-int2": ("quantized", {"backend": "hqq", "nbits": 2, "axis_key": 1, "axis_value": 1}),
    "transformers-fp8": ("quantized", {"backend": "fp8"}),
    "kvpress-snapkv": ("kvpress", {"press": "SnapKVPress"}),
    "kvpress-streaming_llm": ("kvpress", {"press": "StreamingLLMPress"}),
    "kvpress-tova": ("kvpress", {"press": "TOVAPress"}),
    "kvpress-kvzip": ("kvpress", {"press": "KVzipPress"}),
    "kvpress-observed_attention": ("kvpress", {"press": "ObservedAttentionPress", "attn_implementation": "eager"}),
}


def make_peer_cache(peer: str, config):
    """(cache, press): a QuantizedCache, or a DynamicCache and the kvpress press (None but for kvpress's peers)."""
    from transformers import DynamicCache

    if peer == "dynamic":
        return DynamicCache(), None
    _, settings = PEERS[peer]
    if "backend" in settings:
        from transformers import QuantizedCache

        return QuantizedCache(config=config, **settings), None
    import kvpress

    return DynamicCache(), getattr(kvpress, settings["press"])(compression_ratio=round(1.0 - KEEP, 6))


def _cache_argument(model) -> str:
    """`cache` since transformers 5.24, `past_key_values` before (kvpress's environment)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _versions(peer: str) -> dict[str, str]:
    import importlib.metadata as metadata

    packages = ["torch", "transformers"]
    if peer != "dynamic":
        settings = PEERS[peer][1]
        packages += {"quanto": ["optimum-quanto"], "hqq": ["hqq"]}.get(settings.get("backend"), [])
        packages += ["kvpress"] if "press" in settings else []
    return {package: metadata.version(package) for package in packages}


def run_model(model, peer: str, vocab_size: int, length: int, batch: int, new_tokens: int, clock: str) -> dict:
    """One prefill and `new_tokens` greedy decode steps of `model` with `peer`'s cache; what they cost."""
    import torch
    from bench_measure import held_bytes, prompt_ids, timed_run

    ids = prompt_ids(vocab_size, length, batch).to(model.device)
    cache, press = make_peer_cache(peer, model.config)
    cache_kwarg = {_cache_argument(model): cache}

    def prefill(prompt):
        with press(model) if press is not None else contextlib.nullcontext():
            model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwarg)

    def step(token, i):  # positions after the whole prompt, whatever the press left in the cache
        position = torch.full((batch, 1), length + i, dtype=torch.long, device=model.device)
        return model(input_ids=token, position_ids=position, use_cache=True, **cache_kwarg)

    return timed_run(model, ids, prefill, step, new_tokens, clock) | {
        "kv_bytes": held_bytes(cache),
        "kept": cache.get_seq_length(),  # token slots of layer 0 (kvpress's KVzip: masked ones included)
        "versions": _versions(peer),
    }


def run(peer: str, model_dir: str, length: int, batch: int, new_tokens: int, clock: str,
        dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attention = PEERS[peer][1].get("attn_implementation", "sdpa") if peer != "dynamic" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=attention
    ).eval()
    vocab_size = AutoTokenizer.from_pretrained(model_dir).vocab_size
    return run_model(model, peer, vocab_size, length, batch, new_tokens, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", required=True, choices=["dynamic", *PEERS])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args()
    print(json.dumps(run(args.peer, args.model_dir, args.length, args.batch, args.new_tokens, args.clock, args.dtype)))


if __name__ == "__main__":
    main()
