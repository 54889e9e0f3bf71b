"""Our SnapKV and Expected Attention scores beside kvpress 0.5.5's SnapKVPress and ExpectedAttentionPress, on one
prompt (issue 27).

Question: on one document of the suite, how close are our per-(layer, KV head, token) scores to the press of the same
name, how much of the press's kept set does ours keep at each share, and how much of the answer's tokens does each
keep? Which of the two policies' method differences (SnapKV's observation window, pooling; Expected Attention's
query statistics, epsilon) moves ours toward kvpress's?
Command:
    PYTHONPATH=. python benchmarks/probes/press_scores_vs_kvpress.py [--model smollm2-135m] [--task needle] \\
        [--length 2000] [--depth 90] [--index 0] [--split dev] [--out results/press-scores]
Written up: docs/results.md, "SnapKV and Expected Attention beside kvpress (issue 27, session 36; helper i27k)".

kvpress's scores come from press_scores_worker.py (beside it), run in kvpress's environment (benchmarks/.venv-kvpress,
built by benchmarks/harness/peer_envs.py). Ours are computed on the same document prefilled at once, as `hf-kvcompress
eval` prefills a ratio spec: SnapKV's from the attention statistics a `snapkv:ratio=1.0` cache gathers (nothing
evicted), pooled by the policy; Expected Attention's from the keys, values and every query of the document a cache
that holds them gives (`decoding=evict` with a window as long as the document, ratio 1.0), scored by the default
policy, which at a prompt step uses those same queries. Kept sets: ours by the policy's own rule (`select_kept`:
ceil(share x T) per head, sinks and recent protected), kvpress's as its ScorerPress keeps (top int(share x T)).
Printed per press and share: rank correlation over the document (mean over layers and heads), the share of
kvpress's kept pairs ours keeps, the answer tokens kept by each (mean over layers and heads) and per layer.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Literal

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # kvzip_scores_vs_kvpress reaches the kvpress environment (peer_envs.py)

from kvzip_scores_vs_kvpress import kvpress_scores, locate, spearman  # noqa: E402


def prefilled(model, spec: str, document_ids: list[int]):
    from hf_kvcompress import make_cache

    cache = make_cache(spec, model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([document_ids]), cache=cache)
    return cache


def snapkv_scores(model, document_ids, window: int, kernel: int,
                  pooling: Literal["avg", "max"] = "max") -> torch.Tensor:
    """[L, H, T]: our SnapKV's scores (the window's attention, summed over its queries and the KV group's query heads,
    then pooled over `kernel` neighbours by the policy's own rule: `max`, its rule before session 36, or `avg`, its
    default now and SnapKVPress's)."""
    from hf_kvcompress.policies.snapkv import SnapKVPolicy

    cache = prefilled(model, f"snapkv:ratio=1.0,window={window},kernel=1", document_ids)
    accumulated = torch.cat([layer.accumulated for layer in cache.layers])  # [L, H, T]: the layers as the batch
    policy = SnapKVPolicy(ratio=1.0, window=window, kernel=kernel, pooling=pooling)
    return policy.score(accumulated, accumulated.shape[-1])


def expected_attention_scores(model, document_ids, **fields) -> torch.Tensor:
    """[L, H, T]: our Expected Attention's scores of the document by every query of it past the sinks."""
    from hf_kvcompress.policies.expected_attention import ExpectedAttentionPolicy

    tokens = len(document_ids)
    cache = prefilled(model, f"expected_attention:ratio=1.0,decoding=evict,window={tokens}", document_ids)
    policy = ExpectedAttentionPolicy(ratio=0.5, **fields)
    pads = torch.zeros(1, dtype=torch.long)
    return torch.cat([
        policy.score(None, tokens, keys=layer.tail_keys, pads=pads, values=layer.tail_values,
                     queries=layer.scorer.window(layer))
        for layer in cache.layers
    ])


def our_kept(scores: torch.Tensor, share: float, sink_tokens: int, recent: int) -> torch.Tensor:
    """[L, H, T] bool: our rule, ceil(share x T) per head with the first `sink_tokens` and last `recent` kept."""
    tokens = scores.shape[-1]
    scores = scores.clone()
    scores[..., :sink_tokens] = math.inf
    if recent:
        scores[..., tokens - recent :] = math.inf
    return top(scores, math.ceil(share * tokens))


def top(scores: torch.Tensor, count: int) -> torch.Tensor:
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.topk(count, dim=-1).indices, True)


def add_prompt_arguments(parser: argparse.ArgumentParser, task: str) -> None:
    """The options that pick one prompt of the suite (`one_prompt`)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default=task)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depth", type=float, default=90)
    parser.add_argument("--index", type=int, default=0, help="the sample's index in its cell")
    parser.add_argument("--split", default="dev", choices=("dev", "test"))


def one_prompt(args):
    """(model with our attention, tokenizer, the sample, its output folder under args.out (made), document ids,
    question ids) for the prompt `add_prompt_arguments` picked."""
    from hf_kvcompress import load_model, use_kvcompress_attention
    from hf_kvcompress.eval.prompts import encode
    from hf_kvcompress.eval.tasks import build_samples, split_specs

    model, tokenizer = load_model(args.model)
    use_kvcompress_attention(model)
    rows = build_samples(tokenizer, split_specs(args.task), [args.length], [args.depth],
                         samples_per_cell=args.index + 1, seed=0, split=args.split)
    row = next(r for r in rows if r["index"] == args.index)
    out = Path(args.out) / row["sample_id"].replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    document_ids, question_ids = encode(tokenizer, row)
    return model, tokenizer, row, out, document_ids, question_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_arguments(parser, task="needle")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--out", default="results/press-scores")
    args = parser.parse_args()
    from hf_kvcompress.models import ensure_converted

    model, tokenizer, row, out, document_ids, _ = one_prompt(args)
    tokens = len(document_ids)
    answer = locate(document_ids, tokenizer, row["references"][0])
    print(f"{row['sample_id']}: {tokens} tokens, answer {row['references'][0]!r} at tokens {answer}", flush=True)
    theirs = kvpress_scores(str(ensure_converted(args.model)), document_ids, out, worker="press_scores_worker.py",
                            saved="kvpress_press_scores.pt")
    with torch.inference_mode():
        ours = {
            "SnapKVPress": {
                "ours (window 32, max-pool 7)": (snapkv_scores(model, document_ids, 32, 7), 0, 32),
                "ours window 64, max-pool 7": (snapkv_scores(model, document_ids, 64, 7), 0, 64),
                "ours window 64, avg-pool 5": (snapkv_scores(model, document_ids, 64, 5, "avg"), 0, 64),
            },
            "ExpectedAttentionPress": {
                "ours (epsilon 0.01)": (expected_attention_scores(model, document_ids), 4, 0),
                "ours epsilon 0": (expected_attention_scores(model, document_ids, epsilon=0.0), 4, 0),
            },
        }
    for press, variants in ours.items():
        kv = theirs[press]  # [L, H, T]
        protected = kv >= kv.amax(-1, keepdim=True)  # the press's window or sinks (max + 1)
        free = ~protected[0, 0]
        print(f"\n{press}: rank correlation with ours over its unprotected tokens (mean over layers and heads)")
        for name, (scores, _, _) in variants.items():
            rho = [spearman(scores[i, h, free], kv[i, h, free]) for i in range(kv.shape[0]) for h in range(kv.shape[1])]
            print(f"  {name:32s} {sum(rho) / len(rho):.3f}")
        for share in args.shares:
            keep_theirs = top(kv, max(1, int(tokens * share)))
            print(f"  keep {share}: share of kvpress's kept pairs ours keeps | answer tokens kept (mean; per layer)")
            line = " ".join(f"{keep_theirs[i][..., answer].float().mean():.1f}" for i in range(kv.shape[0]))
            print(f"    {'kvpress':32s}  -    | {keep_theirs[..., answer].float().mean():.2f}; {line}")
            for name, (scores, sinks, recent) in variants.items():
                keep = our_kept(scores, share, sinks, recent)
                overlap = (keep & keep_theirs).sum() / keep_theirs.sum()
                line = " ".join(f"{keep[i][..., answer].float().mean():.1f}" for i in range(kv.shape[0]))
                print(f"    {name:32s} {overlap:.3f} | {keep[..., answer].float().mean():.2f}; {line}")


if __name__ == "__main__":
    main()
