"""What a head store's decode step saves by attending over its joined pairs instead of copying them, in one process.

Question: KVzip's and KVzap's head stores attended each decode step over `torch.cat([pairs, tail])` per KV head (a
copy of every held pair); they now attend over views of each head's pairs and tail joined with room
(caches/joined_heads.py). What does that save per model step, measured in one process so that the load of a shared
machine hits both forms alike?
Command:
    python benchmarks/probes/head_store_copy_ab.py [--spec "kvzap:ratio=0.25"] [--tokens 4096] [--batch 1]
        [--dtype float32|bfloat16] [--block 8] [--rounds 10]
Written up: docs/speed.md, "KVzap's decode step without a copy of its pairs".

The cache is prefilled once from the bench's prompt (`hf_kvcompress.prefill`, which also runs KVzip's pass); then
blocks of `--block` decode steps alternate between the two forms of `HeadStore.attend` (`joined`: as shipped;
`copied`: the form before, which settles the store and joins each head's pairs to its tail by `cat` at every step),
`--rounds` times each, after two warm-up steps. Both forms give the same logits (tests/caches/test_head_budgets.py
compares the head store's step with the padded reference). The figure per form is the median over rounds of the mean
process CPU time per step in its blocks, with the median of the paired differences; one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "harness"))  # bench_measure: the bench's prompt


def copied_attend(store, query: torch.Tensor, scaling: float, policy) -> torch.Tensor:
    """`HeadStore.attend` as it was before the joined layout: each head's pairs and tail joined by `cat`."""
    batch, q_heads, _, dim = query.shape
    heads = store.kv_heads
    grouped = query.reshape(batch * heads, 1, q_heads // heads, dim)
    keys = store.encoded.heads(store.codec, "key", store.dtype)  # `encoded` settles a joined store first
    values = store.encoded.heads(store.codec, "value", store.dtype)
    tail_keys, tail_values = store.tail_keys.flatten(0, 1), store.tail_values.flatten(0, 1)
    out = [
        torch.nn.functional.scaled_dot_product_attention(
            grouped[i : i + 1], torch.cat([keys[i], tail_keys[i]])[None, None],
            torch.cat([values[i], tail_values[i]])[None, None], scale=scaling,
        )
        for i in range(batch * heads)
    ]
    return torch.cat(out).reshape(batch, 1, q_heads, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="kvzap:ratio=0.25")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="rows, each the same prompt")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    from bench_measure import prefilled_decoder, prompt_ids

    from hf_kvcompress import load_model, make_cache, use_kvcompress_attention
    from hf_kvcompress.caches.head_store import HeadStore

    torch.set_num_threads(1)
    model, tokenizer = load_model(None, dtype=args.dtype)
    use_kvcompress_attention(model)
    joined_attend = HeadStore.attend
    forms = {"joined": joined_attend, "copied": copied_attend}
    times: dict[str, list[float]] = {form: [] for form in forms}
    with torch.inference_mode():
        ids = prompt_ids(tokenizer.vocab_size, args.tokens, args.batch)  # [B, tokens + 1]: the last decodes first
        decode = prefilled_decoder(model, tokenizer, make_cache(args.spec, model.config), ids)
        decode(2)
        try:
            for _ in range(args.rounds):
                for form, attend in forms.items():
                    HeadStore.attend = attend  # type: ignore[method-assign]
                    start = time.process_time()
                    decode(args.block)
                    times[form].append(1000 * (time.process_time() - start) / args.block)
        finally:
            HeadStore.attend = joined_attend  # type: ignore[method-assign]
    differences = [c - j for c, j in zip(times["copied"], times["joined"], strict=True)]
    print(f"{args.spec} after {args.tokens} tokens x {args.batch} rows, {args.dtype}, {args.rounds} rounds of "
          f"{args.block} steps per form, torch threads {torch.get_num_threads()}")
    for form in forms:
        print(f"{form:8s} ms/step median {statistics.median(times[form]):7.2f}   rounds "
              + " ".join(f"{t:.1f}" for t in times[form]))
    print(f"copied - joined: median {statistics.median(differences):.2f} ms/step, "
          f"{sum(d > 0 for d in differences)} of {len(differences)} rounds positive")


if __name__ == "__main__":
    main()
