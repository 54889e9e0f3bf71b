"""Runs inside the kvpress virtual environment (transformers < 5.3): KVzipPress's scores of one exported document.

Question: kvzip_scores_vs_kvpress.py's, from inside kvpress's environment: which score does kvpress 0.5.5's KVzipPress
give each (layer, KV head, token) pair of a document?
Command: kvzip_scores_vs_kvpress.py runs it; by hand, with the python of the environment kvpress_side_by_side.py
builds:
    benchmarks/.venv-kvpress/bin/python benchmarks/probes/kvzip_scores_worker.py --model-dir DIR \\
        --document OUT/document.json --out OUT/kvpress_scores.pt
Written up: docs/results.md, "KVzip on prose it was not tuned on (issue 27)".

Not importable from hf_kvcompress (another transformers). Prefills the document under KVzipPress as kvpress's pipeline
does (`model.model(input_ids=..., past_key_values=cache)` inside `with press(model)`) and saves the press's
`score_val` [layers, 1, KV heads, tokens] as its reconstruction left it (before `compress_post` protects the sinks),
with the press's `prefix_length` (the chat template's tokens before the user's text, which the press never scores).
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
    from kvpress import KVzipPress

    document_ids = json.load(open(args.document))["document_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    captured = {}
    original = KVzipPress.compress_post

    def compress_post(self, model):
        captured["scores"] = self.score_val.detach().clone().float()
        captured["prefix_length"] = int(self.prefix_length)
        captured["n_sink"] = int(self.n_sink)
        return original(self, model)

    KVzipPress.compress_post = compress_post
    press = KVzipPress(compression_ratio=0.5)
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([document_ids]), past_key_values=DynamicCache())
    torch.save(captured, args.out)


if __name__ == "__main__":
    main()
