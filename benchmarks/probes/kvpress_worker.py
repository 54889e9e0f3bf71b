"""Runs inside the kvpress virtual environment (transformers < 5.3): kvpress's presses on exported prompts.

Question: kvpress_side_by_side.py's, from inside kvpress's environment: what does each press answer on each exported
prompt, and how many bytes does its cache hold?
Command: kvpress_side_by_side.py runs it; by hand, with the python of the environment it builds:
    benchmarks/.venv-kvpress/bin/python benchmarks/probes/kvpress_worker.py --model-dir DIR \\
        --prompts OUT/prompts.jsonl --presses snapkv,kvzip --keep 0.5,0.25 --out OUT/kvpress.jsonl
Written up: with kvpress_side_by_side.py's table (docs/results.md, "Eviction policies side by side (question after the
document)").

Not importable from hf_kvcompress (it must not import it: another transformers). Reads prompts.jsonl (document and
question token ids, as our runner encodes them), compresses each document with a press the way kvpress's pipeline
does (prefill of the document under the press, then the question and greedy decoding without it) and writes one
JSON line per (press, ratio, sample): the answer and the bytes the cache really holds after compression.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
from transformers import AutoModelForCausalLM, DynamicCache

PRESSES = {
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "streaming_llm": "StreamingLLMPress",
    "observed_attention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
    "expected_attention": "ExpectedAttentionPress",
    "keydiff": "KeyDiffPress",
    "knorm": "KnormPress",
}


def make_press(name: str, keep: float):
    import kvpress

    cls = getattr(kvpress, PRESSES[name])
    return cls(compression_ratio=round(1.0 - keep, 6))  # kvpress's ratio is the share removed


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


@torch.inference_mode()
def answer(model, document_ids, question_ids, press, max_new_tokens, eos):
    cache = DynamicCache()
    context = torch.tensor([document_ids])
    if press is None:
        model.model(input_ids=context, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
    held = cache_bytes(cache)
    position = len(document_ids)  # positions continue after the whole document, as in kvpress's pipeline
    question = torch.tensor([question_ids])
    positions = torch.arange(position, position + question.shape[1])[None]
    out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
    generated = [int(out.logits[0, -1].argmax())]
    next_position = positions[:, -1:] + 1
    for i in range(max_new_tokens - 1):
        if generated[-1] in eos:
            break
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, position_ids=next_position + i)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated, held


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--presses", required=True)
    parser.add_argument("--keep", required=True, help="comma-separated shares of the document kept, e.g. 0.5,0.25")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import kvpress
    from transformers import AutoTokenizer

    # ObservedAttentionPress needs eager attention (the weights); KVzipPress refuses it: each gets what it needs.
    models = {}

    def model_for(press_name: str):
        implementation = "eager" if press_name == "observed_attention" else "sdpa"
        if implementation not in models:
            models[implementation] = AutoModelForCausalLM.from_pretrained(
                args.model_dir, dtype=torch.float32, attn_implementation=implementation
            )
        return models[implementation]

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    eos = model_for("none").generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    prompts = [json.loads(line) for line in open(args.prompts)]
    plans = [("none", 1.0)] + [(p, float(k)) for p in args.presses.split(",") for k in args.keep.split(",")]
    done = set()
    try:
        for line in open(args.out):
            record = json.loads(line)
            done.add((record["press"], record["keep"], record["sample_id"]))
    except FileNotFoundError:
        pass
    with open(args.out, "a") as sink:
        for press_name, keep in plans:
            for prompt in prompts:
                if (press_name, keep, prompt["sample_id"]) in done:
                    continue
                record = {"press": press_name, "keep": keep, "sample_id": prompt["sample_id"],
                          "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5"}
                start = time.perf_counter()
                try:
                    press = None if press_name == "none" else make_press(press_name, keep)
                    ids, held = answer(model_for(press_name), prompt["document_ids"], prompt["question_ids"], press,
                                       prompt["max_new_tokens"], eos)
                    record.update(prediction=tokenizer.decode(ids, skip_special_tokens=True), kv_bytes=held)
                except Exception as error:  # a press that refuses this model is a result, not a crash
                    record.update(error=f"{type(error).__name__}: {error}", trace=traceback.format_exc(limit=3))
                record["seconds"] = time.perf_counter() - start
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                if "error" in record:
                    print(f"{press_name} keep={keep}: {record['error']}", flush=True)
                    break  # the same refusal would repeat for every sample


if __name__ == "__main__":
    main()
