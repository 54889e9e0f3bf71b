"""Our KVzip's reconstruction scores beside kvpress 0.5.5's KVzipPress's, on one prose document (issue 27).

Question: on a prose document the suite's needle task does not use (the multi_question task's Botchan, development
half: no "a number is hidden" instruction, facts of several kinds, chat template), where do our per-(layer, KV head,
token) scores differ from KVzipPress's, and which tenths of the document and which facts does each keep when one
ranking of every pair keeps a share (KVzip's own allocation)?
Command:
    PYTHONPATH=. python benchmarks/probes/kvzip_scores_vs_kvpress.py [--model smollm2-135m] [--length 2000] \\
        [--depths 2 10 30 50 70 90] [--index 0] [--spec kvzip:ratio=1.0] [--out results/kvzip-scores]
Written up: docs/results.md, "KVzip on prose it was not tuned on (issue 27)".

kvpress's scores come from kvzip_scores_worker.py (beside it), run in kvpress's own environment (benchmarks/
.venv-kvpress, built by benchmarks/harness/peer_envs.py). Ours are the scorer's `slots.accumulated` of every
layer at the end of the reconstruction pass, before anything is evicted (`--spec` with ratio=1.0 keeps everything;
its other parameters choose the pass). Printed: per layer the rank correlation of the two scores over the user's
text; per rule and share kept, the share of each tenth of the user's text kept (averaged over layers and heads),
the share of the chat template's tokens before it kept, and the share of each fact's answer tokens kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "harness"))  # the kvpress environment is the bench's (peer_envs.py)

from peer_envs import KVPRESS_VENV, ensure_kvpress_venv  # noqa: E402


def kvpress_scores(model_dir: str, document_ids: list[int], out: Path, worker: str = "kvzip_scores_worker.py",
                   saved: str = "kvpress_scores.pt") -> dict:
    """The scores `worker` (a script beside this one) captures from kvpress's presses on the document, in kvpress's own
    environment (default: KVzipPress's); saved under `out`/`saved` and read from there on a later run."""
    path = out / saved
    if not path.exists():
        (out / "document.json").write_text(json.dumps({"document_ids": document_ids}))
        python = ensure_kvpress_venv(KVPRESS_VENV)
        subprocess.run([str(python), str(HERE / worker), "--model-dir", model_dir,
                        "--document", str(out / "document.json"), "--out", str(path)], check=True)
    return torch.load(path)


def our_scores(model, tokenizer, document_ids: list[int], spec: str, skip: int = 0) -> torch.Tensor:
    """[layers, KV heads, tokens]: each scored layer's reconstruction scores as the pass leaves them. `skip`: the
    pass repeats the document from its token `skip` on (as KVzipPress, which repeats the user's text only)."""
    from hf_kvcompress import generation, make_cache, prefill, repeat_prompt_ids

    cache = make_cache(spec, model.config)
    if skip:
        original = generation.score_by_reconstruction

        def from_text(model, input_ids, attention_mask, cache, *args):
            return original(model, input_ids[:, skip:], attention_mask, cache, *args)

        generation.score_by_reconstruction = from_text
    captured = []
    end = cache.end_reconstruction

    def capture(evict: bool = True):
        captured.extend(layer.slots.accumulated[0].clone() for layer in cache.layers
                        if layer.policy.scores_by_reconstruction and not layer.is_sliding)
        return end(evict)

    cache.end_reconstruction = capture
    try:
        prefill(model, torch.tensor([document_ids]), None, cache, repeat_prompt_ids=repeat_prompt_ids(tokenizer))
    finally:
        if skip:
            generation.score_by_reconstruction = original
    return torch.stack(captured)


def mean_rank_correlation(ours: torch.Tensor, theirs: torch.Tensor, span: slice, layers) -> float:
    """Spearman's rank correlation of two [L, H, T] score tensors over `span`, averaged over `layers` and every head."""
    heads = range(theirs.shape[1])
    pairs = [(i, h) for i in layers for h in heads]
    return sum(spearman(ours[i, h, span], theirs[i, h, span]) for i, h in pairs) / len(pairs)


def global_keep(scores: torch.Tensor, share: float, span: int = 0, sinks: int = 0) -> torch.Tensor:
    """Keep mask [L, H, T]: one ranking of every pair keeps `share` of them, the first `sinks` tokens always
    (KVzipPress's rule with sinks=4; ours with sinks=0 and `span`: the raw ranking sets each head's count, the
    span-pooled scores which pairs)."""
    scores = scores.clone()
    if sinks:
        scores[..., :sinks] = float("inf")
    total = round(scores.numel() * share)
    flat = scores.flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.topk(total).indices] = True
    keep = keep.view_as(scores)
    if span:
        layers, heads, tokens = scores.shape
        pooled = F.max_pool1d(F.pad(scores.reshape(-1, 1, tokens), (0, span), value=float("-inf")), span + 1, 1)
        pooled = pooled.view_as(scores)
        counts = keep.sum(-1)
        keep = torch.zeros_like(keep)
        order = pooled.argsort(-1, descending=True)
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, order, torch.arange(tokens).expand_as(order))
        keep = ranks < counts[..., None]
    return keep


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().float()
    rb = b.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def locate(document_ids: list[int], tokenizer, answer: str) -> list[int]:
    """Token positions of the answer's tokens in the document (as written inside a sentence: a leading space)."""
    for text in (" " + answer, answer):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for i in range(len(document_ids) - len(ids) + 1):
            if document_ids[i : i + len(ids)] == ids:
                return list(range(i, i + len(ids)))
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depths", type=float, nargs="+", default=[2, 10, 30, 50, 70, 90])
    parser.add_argument("--index", type=int, default=0, help="the document's index in the development half")
    parser.add_argument("--spec", default="kvzip:ratio=1.0", help="our pass (ratio=1.0: nothing evicted)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--out", default="results/kvzip-scores")
    args = parser.parse_args()
    from hf_kvcompress import load_model, use_kvcompress_attention
    from hf_kvcompress.eval.prompts import encode
    from hf_kvcompress.eval.tasks import build_samples
    from hf_kvcompress.models import ensure_converted

    out = Path(args.out) / f"{args.model}-L{args.length}-i{args.index}"
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model)
    use_kvcompress_attention(model)
    rows = [dict(r) for r in build_samples(tokenizer, ["multi_question"], [args.length], args.depths,
                                           samples_per_cell=args.index + 1, seed=0, split="dev")]
    rows = [r for r in rows if r["index"] == sorted({r["index"] for r in rows})[args.index]]
    document_ids, _ = encode(tokenizer, rows[0])
    theirs = kvpress_scores(str(ensure_converted(args.model)), document_ids, out)
    prefix = theirs["prefix_length"]
    kv = theirs["scores"][:, 0]  # [L, H, T]
    tokens = len(document_ids)
    text = slice(prefix, tokens)
    print(f"{args.model}: {tokens} document tokens, {prefix} chat-template tokens before the user's text", flush=True)
    variants = {}
    for name, skip in (("ours", 0), ("ours, text repeated", prefix)):
        path = out / f"ours-{args.spec.replace(':', '_').replace(',', '_')}-skip{skip}.pt"
        if not path.exists():
            torch.save(our_scores(model, tokenizer, document_ids, args.spec, skip), path)
        variants[name] = torch.load(path)
    tenth = (tokens - prefix) // 10
    for name, ours in variants.items():
        print(f"{name} vs kvpress, rank correlation per layer over the user's text (mean over heads):")
        layers = range(kv.shape[0])
        print(" ".join(f"{mean_rank_correlation(ours, kv, text, [i]):.2f}" for i in layers))
        print("  per tenth (mean over layers and heads):", " ".join(
            f"{mean_rank_correlation(ours, kv, slice(prefix + t * tenth, prefix + (t + 1) * tenth), layers):.2f}"
            for t in range(10)))
    for name, s in (*variants.items(), ("kvpress", kv)):
        mass = s.sum((0, 1))
        print(f"{name}: score mass on the template prefix {mass[:prefix].sum() / mass.sum():.3f}, first tenth "
              f"{mass[text][:tenth].sum() / mass.sum():.3f}; median score per tenth:",
              " ".join(f"{c.median():.4f}" for c in s[..., text].chunk(10, dim=-1)))
    facts = [(r["depth"], r["references"][0], locate(document_ids, tokenizer, r["references"][0])) for r in rows]
    rules = {"kvpress (4 sinks)": (kv, 0, 4), "kvpress scores + span 4": (kv, 4, 4)}
    for name, ours in variants.items():
        rules.update({f"{name} (span 4)": (ours, 4, 0), f"{name} (span 0)": (ours, 0, 0),
                      f"{name}, 4 sinks": (ours, 4, 4)})
    for share in args.shares:
        print(f"\nkeep {share}: prefix kept | kept per tenth of the user's text | fact tokens kept (depth: share)")
        for name, (scores, span, sinks) in rules.items():
            keep = global_keep(scores, share, span, sinks).float()
            tenths = keep[..., text].mean((0, 1)).chunk(10)
            fact_kept = " ".join(f"{d:g}:{keep[..., p].mean():.2f}" for d, _, p in facts if p)
            print(f"  {name:36s} {keep[..., :prefix].mean():.2f} | {' '.join(f'{c.mean():.2f}' for c in tenths)} | "
                  f"{fact_kept}")


if __name__ == "__main__":
    main()
