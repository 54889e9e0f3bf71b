"""GPU: decode ms per token through `model.generate(cache=...)`, DynamicCache against compressed caches.

Question: on a GPU, what does a user who passes a compressed cache to `generate` pay per decoded token against
DynamicCache, at long prompts, batch 1 and 8? (`gpu_decode_attention.py` times one layer's read alone; this times
the whole model's step, host overhead included, as a user meets it.)
Command:
    python benchmarks/probes/gpu_generate_speed.py [--specs "int4;int2;snapkv:ratio=0.25"] [--lengths 8192,32768]
        [--batches 1,8] [--new-tokens 33] [--device cuda] [--tiny]
Written up: not yet: scripted in session 26, whose device time ran out before it printed (docs/speed.md, "On a
GPU"). `--device cpu --tiny` runs it on CPU with a two-layer model (tests/test_benchmarks_layout.py runs that).

The model is a Llama-3.2-1B-shaped decoder (16 layers, 32 query heads on 8 KV heads of 64 dims, bf16) with random
weights, built from its config (no download): the weights' values do not change the cost of a step. For each
length, batch and spec: decode ms/token = (time of generate with N new tokens - time with 1) / (N - 1), each with a
fresh cache, after a warm-up that compiles the kernels' variants (the tail's lengths pass through Triton's integer
specialisations). DynamicCache is measured in the same process, beside each spec. Specs that `model.generate`
alone cannot run (KVzip reads the prompt twice: `hf_kvcompress.prefill`) are not this probe's.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers import DynamicCache

from hf_kvcompress import make_cache

SHAPES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


def _model(shape: str, device: str, dtype: torch.dtype):
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=140000, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # random weights: every run decodes its full length
    return model


def _seconds(model, spec: str, ids: torch.Tensor, new: int) -> float:
    cache = DynamicCache() if spec == "dynamic" else make_cache(spec, model.config)
    _sync(ids.device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                   min_new_tokens=new, do_sample=False)
    _sync(ids.device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", default="int4;int2;fp8;snapkv:ratio=0.25;sink_window:sink_tokens=4,window=1020")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model (a dry run on CPU)")
    args = parser.parse_args()
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be at least 2, got {args.new_tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (--device cpu --tiny is the dry run)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _model("tiny" if args.tiny else "1b", args.device, dtype)
    vocab = model.config.vocab_size
    specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    warm = torch.randint(3, vocab, (1, 700), device=device)
    for spec in ["dynamic", *specs]:
        _seconds(model, spec, warm, 8 if args.tiny else 200)
    print(f"{'tokens':>7s} {'batch':>5s} {'cache':40s} {'ms/token':>9s} {'x dynamic':>9s}")
    for tokens in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            ids = torch.randint(3, vocab, (batch, tokens), device=device)
            per_token = {}
            for spec in ["dynamic", *specs]:
                first = _seconds(model, spec, ids, 1)
                full = _seconds(model, spec, ids, args.new_tokens)
                per_token[spec] = (full - first) / (args.new_tokens - 1)
                ratio = per_token[spec] / per_token["dynamic"]
                print(f"{tokens:7d} {batch:5d} {spec:40s} {per_token[spec] * 1e3:9.2f} {ratio:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
