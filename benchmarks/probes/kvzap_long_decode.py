"""Does `kvzap:budget=N` hold its bytes while decoding, and still answer what the document said?

Question: (issue 28's decoding target) after a 2k-token document, a cache decodes 512 new tokens (the model's own
greedy continuation, EOS suppressed), then a question is appended and answered. How many bytes does the cache hold
at each decode step, and which answers of the uncompressed cache does it keep, beside `kvzip:ratio=0.5` on the same
documents?
Command:
    python benchmarks/probes/kvzap_long_decode.py [--model smollm2-135m] [--split test]
        [--methods "dynamic" "kvzip:ratio=0.5" "kvzap:budget=1024"] [--new-tokens 512]
        [--tasks needle multi_question] [--lengths 2000] [--depths 10 50 90] [--samples 2]
Written up: docs/results.md, "KVzap while decoding".

Each method: the document is prefilled with `hf_kvcompress.prefill` (KVzip's reconstruction pass; KVzap's ranking
at its end), the continuation is decoded with `hf_kvcompress.generation.generate` (model.generate's path), and each
question of the document is asked of its own copy of the cache after the continuation. Bytes are the cache's
storage counted in the served dtype (`served_kv_bytes`, bf16 unless the config says otherwise), after every step.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections import defaultdict

import torch

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention
from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.runner import served_torch_dtype
from hf_kvcompress.eval.scoring import score_all
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate
from hf_kvcompress.measure import served_kv_bytes


class Meter:
    """A streamer: the cache's served bytes after every step (the first put is the prompt's)."""

    def __init__(self, cache, dtype):
        self.cache, self.dtype, self.bytes = cache, dtype, []

    def put(self, value):
        self.bytes.append(served_kv_bytes(self.cache, self.dtype))

    def end(self):
        pass


@torch.inference_mode()
def continued(model, doc, cache, prompt, new_tokens, dtype):
    """(the cache after the document and `new_tokens` decoded tokens, the ids it has seen plus the last token,
    bytes after the document, bytes after each decode step)."""
    ids = torch.tensor([doc])
    prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=prompt)
    after_document = served_kv_bytes(cache, dtype)
    meter = Meter(cache, dtype)
    out = generate(model, ids, None, cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=meter)
    return cache, doc + out.new_tokens[0].tolist(), after_document, meter.bytes[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["dynamic", "kvzip:ratio=0.5", "kvzap:budget=1024"])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--tasks", nargs="+", default=["needle", "multi_question"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000])
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if "dynamic" not in args.methods:
        raise ValueError("--methods needs 'dynamic': retention counts the answers the uncompressed cache gives")

    model, tok = load_model(args.model)
    use_kvcompress_attention(model)
    dtype = served_torch_dtype(model)
    prompt = repeat_prompt_ids(tok)
    rows = [dict(r) for r in build_samples(tok, args.tasks, args.lengths, args.depths,
                                           samples_per_cell=args.samples, seed=0, split=args.split)]
    kept = defaultdict(int)
    traces = defaultdict(list)  # method -> (bytes after the document, per-step bytes) per document
    answered = 0
    documents: dict[tuple, dict] = {}
    for n, row in enumerate(rows):
        doc, question = encode(tok, row)
        if tuple(doc) not in documents:
            documents.clear()
            states = {}
            for method in args.methods:
                cache, seen, after_document, steps = continued(
                    model, doc, make_cache(method, model.config), prompt, args.new_tokens, dtype)
                states[method] = (cache, seen)
                traces[method].append((after_document, steps))
                tail = steps[len(steps) // 2 :]
                print(f"  {method}: bytes after the document {after_document}, at decode steps 1/128/256/512: "
                      f"{steps[0]}/{steps[min(127, len(steps) - 1)]}/{steps[min(255, len(steps) - 1)]}/{steps[-1]}, "
                      f"second half min/max {min(tail)}/{max(tail)}", flush=True)
            documents[tuple(doc)] = states
        results = {}
        for method, (cache, seen) in documents[tuple(doc)].items():
            ids = torch.tensor([seen + question])
            with torch.inference_mode():
                out = generate(model, ids, None, copy.deepcopy(cache), max_new_tokens=row["max_new_tokens"])
            text = tok.decode(out.new_tokens[0], skip_special_tokens=True)
            results[method] = score_all([text], [row["references"]])[row["metric"]][0] >= 100.0
        if not results["dynamic"]:
            print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: dynamic misses", flush=True)
            continue
        answered += 1
        for method in args.methods:
            kept[method] += results[method]
        print(f"[{n + 1}/{len(rows)}] {row['task']} depth {row['depth']}: "
              + " ".join(f"{m}={int(results[m])}" for m in args.methods), flush=True)
    print(f"\n{args.model} {args.tasks} {args.split} half, lengths {args.lengths}, {args.new_tokens} tokens decoded "
          f"before each question: answers kept of the {answered} dynamic answers")
    for method in args.methods:
        firsts = [a for a, _ in traces[method]]
        peaks = [max(s) for _, s in traces[method]]
        settled = [s[-1] for _, s in traces[method]]
        spread = [max(s[len(s) // 2 :]) - min(s[len(s) // 2 :]) for _, s in traces[method]]
        print(f"{method:>22}: {kept[method]} / {answered}; bytes after the document {sum(firsts) / len(firsts):.0f}, "
              f"peak while decoding {sum(peaks) / len(peaks):.0f}, at the last step {sum(settled) / len(settled):.0f}, "
              f"second half's max - min {sum(spread) / len(spread):.0f} (means over documents)")


if __name__ == "__main__":
    main()
