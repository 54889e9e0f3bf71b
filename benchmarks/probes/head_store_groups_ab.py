"""What a head store's decode step saves by attending over heads of close lengths in one call, in one process.

Question: KVzip's and KVzap's head stores attended each decode step with one SDPA call per (row, KV head): at batch 8
on SmolLM2, 24 calls per layer where a DynamicCache of the kept tokens makes one. They now group heads whose pairs are
equal or close (caches/joined_heads.py `group_heads`) into one call each group, gaps masked. What does that save per
model step, against the form before and against the floor (a DynamicCache of as many tokens as the store keeps per
head), measured in one process so that the load of a shared machine hits all three alike?
Command:
    python benchmarks/probes/head_store_groups_ab.py [--spec "kvzap:ratio=0.25"] [--tokens 4096] [--batch 1]
        [--dtype float32|bfloat16] [--block 8] [--rounds 6] [--full]
Written up: docs/speed.md, "Per-head stores in groups".

The head store's cache is prefilled once from the bench's prompt (`hf_kvcompress.prefill`, which also runs KVzip's
pass), and a DynamicCache with the prompt's newest K tokens, K the pairs the store holds per (row, KV head) on
average after two warm-up steps (`stored_tokens`): the floor. Then blocks of `--block` decode steps alternate between
`grouped` (`JoinedHeads.attend` as shipped), `per_head` (the form before: one SDPA per head over the same views) and
`floor`, `--rounds` times each; the floor decodes a second block each round, untimed, to grow as the store does. The
two head-store forms give the same logits within float rounding (tests/caches/test_kvzap.py, test_joined_heads.py).
The figure per form is the median over rounds of the mean process CPU time per step in its blocks, with the median of
the paired differences and ratios; one torch thread. Also printed: SDPA calls per layer step (groups) against heads,
and the gaps' share of the rows the joined buffers hold. `--full`: a DynamicCache of the whole prompt joins the
rounds too (`full`, grown as the floor), for the ratio the issues' targets name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "harness"))  # bench_measure: the bench's prompt


def per_head_attend(joined, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """`JoinedHeads.attend` before groups: one SDPA per (row, KV head) over its pairs and tail, as views."""
    keys, values = joined.views(0), joined.views(1)
    return torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            query[i : i + 1], keys[i][None, None], values[i][None, None], scale=scaling)
        for i in range(query.shape[0])
    ])


def layout(cache) -> tuple[float, float, float]:
    """(SDPA calls per layer step, heads per layer, gaps / rows held) over the cache's joined head stores now."""
    joined = [layer.store.joined for layer in cache.layers if getattr(layer.store, "joined", None) is not None]
    if not joined:
        return 0.0, 0.0, 0.0
    rows = sum(sum(j.counts) + j.gaps + len(j.counts) * j.capacity for j in joined)
    return (statistics.mean(len(j.groups) for j in joined), statistics.mean(len(j.counts) for j in joined),
            sum(j.gaps for j in joined) / rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="kvzap:ratio=0.25")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="rows, each its own draw of the bench's prompt")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--full", action="store_true", help="also a DynamicCache of the whole prompt")
    args = parser.parse_args()
    from bench_measure import prefilled_decoder, prompt_ids
    from transformers import DynamicCache

    from hf_kvcompress import load_model, make_cache, use_kvcompress_attention
    from hf_kvcompress.caches.joined_heads import JoinedHeads

    torch.set_num_threads(1)
    model, tokenizer = load_model(None, dtype=args.dtype)
    use_kvcompress_attention(model)
    grouped_attend = JoinedHeads.attend
    forms = ("grouped", "per_head", "floor", *(("full",) if args.full else ()))
    times: dict[str, list[float]] = {form: [] for form in forms}
    seen: list[tuple[float, float, float]] = []
    with torch.inference_mode():
        ids = prompt_ids(tokenizer.vocab_size, args.tokens, args.batch)  # [B, tokens + 1]: the last decodes first
        cache = make_cache(args.spec, model.config)
        decode = {"grouped": prefilled_decoder(model, tokenizer, cache, ids)}
        decode["grouped"](2)
        decode["per_head"] = decode["grouped"]
        kept = cache.stored_tokens
        floor = DynamicCache(config=model.config)
        decode["floor"] = prefilled_decoder(model, tokenizer, floor, ids[:, -(kept + 1):])
        decode["floor"](2)
        if args.full:
            decode["full"] = prefilled_decoder(model, tokenizer, DynamicCache(config=model.config), ids)
            decode["full"](2)
        try:
            for _ in range(args.rounds):
                for form in forms:
                    JoinedHeads.attend = per_head_attend if form == "per_head" else grouped_attend  # type: ignore
                    start = time.process_time()
                    decode[form](args.block)
                    times[form].append(1000 * (time.process_time() - start) / args.block)
                    if form == "grouped":
                        seen.append(layout(cache))
                for form in forms[2:]:  # untimed: the DynamicCaches grow as the head store does (two blocks a round)
                    decode[form](args.block)
        finally:
            JoinedHeads.attend = grouped_attend  # type: ignore[method-assign]
    print(f"{args.spec} after {args.tokens} tokens x {args.batch} rows, {args.dtype}, {args.rounds} rounds of "
          f"{args.block} steps per form, torch threads {torch.get_num_threads()}; the floor: DynamicCache of "
          f"{kept} tokens, {floor.get_seq_length()} at the end; the head store holds {cache.stored_tokens} per "
          "head at the end")
    calls, heads, gaps = (statistics.mean(s[i] for s in seen) for i in range(3))
    print(f"SDPA calls per layer step: grouped {calls:.1f}, per_head {heads:.1f}; gaps {gaps:.2%} of the rows held")
    for form in forms:
        print(f"{form:8s} ms/step median {statistics.median(times[form]):7.2f}   rounds "
              + " ".join(f"{t:.1f}" for t in times[form]))
    saved = [p - g for p, g in zip(times["per_head"], times["grouped"], strict=True)]
    print(f"per_head - grouped: median {statistics.median(saved):.2f} ms/step, "
          f"{sum(d > 0 for d in saved)} of {len(saved)} rounds positive")
    for base in forms[2:]:
        for form in ("grouped", "per_head"):
            ratios = [t / f for t, f in zip(times[form], times[base], strict=True)]
            print(f"{form} / {base}: median of the paired rounds {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
