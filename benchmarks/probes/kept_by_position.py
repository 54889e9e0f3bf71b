"""Which part of a 2,000-token needle document each scoring rule would keep at ratio 0.5 (full-attention layers).

Question: which tenths of the document does each eviction policy's scoring keep at ratio 0.5, and does it keep the
needle's tokens?
Command:
    python benchmarks/probes/kept_by_position.py gemma-3-270m "h2o:ratio=0.5" "tova:ratio=0.5" \\
        "snapkv:ratio=0.5" "kvzip:ratio=0.5"
Written up: docs/results.md, "Eviction policies side by side (question
after the document)", and its "Expected Attention" part.

Runs each policy with ratio=1.0 (nothing evicted, scores kept), then applies the policy's own selection at 0.5 and
prints the share of each tenth of the document that survives, averaged over full-attention layers and KV heads,
and whether the needle's tokens survive.
"""

from __future__ import annotations

import argparse

import torch

from hf_kvcompress import load_model, make_cache, parse_spec, prefill, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.policies.base import select_kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model alias or path, e.g. gemma-3-270m")
    parser.add_argument("specs", nargs="+", help='eviction specs at ratio=0.5, e.g. "h2o:ratio=0.5"')
    args = parser.parse_args()
    model, tok = load_model(args.model)
    use_kvcompress_attention(model)
    rows = [dict(r) for r in build_samples(tok, ["needle"], [2000], [100], samples_per_cell=1, seed=0)]
    doc, _ = encode(tok, rows[0])
    ids = torch.tensor([doc])
    needle = rows[0]["references"][0]
    # Locate the needle's answer tokens in the document.
    ans = tok(needle, add_special_tokens=False).input_ids
    pos = [i for i in range(len(doc) - len(ans) + 1) if doc[i:i + len(ans)] == ans]
    print(args.model, "document tokens", len(doc), "answer", needle, "at", pos, flush=True)
    for spec in args.specs:
        unevicted = spec.replace("ratio=0.5", "ratio=1.0")
        if spec.startswith("kvzip") and "budgets" not in spec:
            unevicted += ",budgets=uniform"
        cache = make_cache(unevicted, model.config)
        prefill(model, ids, None, cache, repeat_prompt_ids=repeat_prompt_ids(tok))
        policy = parse_spec(spec)[0]
        shares, needle_kept = [], []
        for layer in cache.layers:
            if layer.is_sliding:
                continue
            T = layer.stored_tokens
            keys = layer._full("key") if policy.needs_keys else None
            extra = {"values": layer._full("value")} if policy.needs_values else {}
            extra.update(layer.scorer.score_inputs(layer))  # Expected Attention: the queries the layer kept
            scores = policy.score(layer.accumulated, T, keys=keys, positions=layer.positions, pads=layer.pads, **extra)
            kept = select_kept(policy, scores, layer.pads, layer.kv_heads, T, policy.kept_per_row(layer.real_seen))
            mask = torch.zeros(layer.kv_heads, T)
            mask.scatter_(1, kept[0], 1.0)
            shares.append(torch.stack([c.mean() for c in mask.mean(0).chunk(10)]))
            if pos:
                needle_kept.append(mask[:, pos[0]:pos[0] + len(ans)].mean().item())
        share = torch.stack(shares).mean(0)
        print(spec, "kept share per tenth:", " ".join(f"{v:.2f}" for v in share.tolist()),
              "| needle tokens kept:", f"{sum(needle_kept) / max(len(needle_kept), 1):.2f}", flush=True)


if __name__ == "__main__":
    main()
