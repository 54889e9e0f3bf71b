"""Runs inside the kvpress virtual environment (transformers < 5.3): SnapKVPress's and ExpectedAttentionPress's
scores of one exported document.

Question: press_scores_vs_kvpress.py's, from inside kvpress's environment: which score does each of kvpress 0.5.5's
SnapKVPress and ExpectedAttentionPress (their defaults) give each (layer, KV head, token) pair of a document?
Command: press_scores_vs_kvpress.py runs it; by hand, with the python of the environment kvpress_side_by_side.py
builds:
    benchmarks/.venv-kvpress/bin/python benchmarks/probes/press_scores_worker.py --model-dir DIR \\
        --document OUT/document.json --out OUT/kvpress_press_scores.pt
Written up: docs/results.md, "SnapKV and Expected Attention beside kvpress (issue 27, session 36; helper i27k)".

Not importable from hf_kvcompress (another transformers). Prefills the document under each press as kvpress's
pipeline does (`model.model(input_ids=..., past_key_values=cache)` inside `with press(model)`) and saves what each
press's `score` returns, per layer [1, KV heads, tokens] (SnapKV's observation window and Expected Attention's sinks
carry the press's max + 1, which keeps them).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--document", required=True, help="JSON with document_ids")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import kvpress

    document_ids = json.load(open(args.document))["document_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    captured = {}
    for name in ("SnapKVPress", "ExpectedAttentionPress"):
        press = getattr(kvpress, name)(compression_ratio=0.5)
        scores = captured.setdefault(name, {})
        original = press.score

        def score(module, *args, original=original, scores=scores, **kwargs):
            result = original(module, *args, **kwargs)
            scores[module.layer_idx] = result.detach().float().clone()
            return result

        press.score = score
        with torch.inference_mode(), press(model):
            model.model(input_ids=torch.tensor([document_ids]), past_key_values=DynamicCache())
    torch.save({name: torch.cat([s[i] for i in sorted(s)]) for name, s in captured.items()}, args.out)


if __name__ == "__main__":
    main()
