"""`hf-kvcompress eval`: long-context tasks x cache methods, document first, question after compression.

Results append to OUT/results.jsonl (a rerun skips finished method/sample pairs); OUT/summary.md, summary.csv,
heatmap_<method>.png and quality_vs_memory.png are rewritten at the end. Shard over processes with
`accelerate launch -m hf_kvcompress.eval ARGS` (same arguments).
"""

from __future__ import annotations

import argparse
import time


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The eval options; shared with `python -m hf_kvcompress.eval` (the accelerate entry point)."""
    parser.add_argument("--model", default=None, help="alias, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--methods", default="dynamic",
                        help='comma-separated cache specs, e.g. "dynamic,int4,sink_window:window=256,h2o:budget=256"; '
                             "dynamic (uncompressed) is always added as the baseline")  # fmt: skip
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks: needle, multi_needle, kv_retrieval, doc_qa, user_needle, "
                             "user_recall; parameters as in needle:kind=passkey or multi_needle:keys=4,values=2 "
                             "(default: needle, plus user_needle,user_recall with --documents)")  # fmt: skip
    parser.add_argument("--lengths", type=_ints, default=[1000, 2000, 3000], help="prompt lengths in the model's tokens (default 1000,2000,3000)")
    parser.add_argument("--depths", type=_floats, default=[0, 25, 50, 75, 100], help="depths in percent of the document (default 0,25,50,75,100)")
    parser.add_argument("--samples", type=int, default=1, help="samples per (task, length, depth) cell (default 1)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many samples per task (quick runs)")
    parser.add_argument("--seed", type=int, default=0, help="sample generation seed (default 0); decoding is greedy")
    parser.add_argument("--documents", default=None, help="a folder of .txt, .md, .jsonl files for user_needle and user_recall")
    parser.add_argument("--query-aware", action="store_true", help="also put the question before the document, inside the compressed prompt")
    parser.add_argument("--prompt-format", choices=("auto", "chat", "plain"), default="auto",
                        help="chat: the tokenizer's chat template; plain: 'document, question, answer' (auto: chat if the tokenizer has one)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=1,
                        help="samples per forward pass, left-padded; rows share a task and question length (default 1)")  # fmt: skip
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk for methods with bounded memory (default 512)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu (per process under accelerate)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--out", required=True, help="output folder: results.jsonl, summary.md/.csv, plots, data/")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="long-context tasks (needle grid, multi-needle, kv retrieval, document QA, your documents) per cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..eval.runner import _state, run_eval
    from ..eval.tasks import split_specs
    from ..models import load_model

    if args.tasks is None:
        tasks = ["needle"] + (["user_needle", "user_recall"] if args.documents else [])
    else:
        tasks = split_specs(args.tasks)
    methods = split_specs(args.methods)
    state = _state()
    device = args.device or (str(state.device) if state is not None else None)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device, dtype=args.dtype)
    records = run_eval(
        model, tokenizer, methods, tasks, args.lengths, args.depths, args.out,
        samples_per_cell=args.samples, seed=args.seed, documents=args.documents, query_aware=args.query_aware,
        prompt_format=args.prompt_format, batch_size=args.batch_size, chunk_size=args.chunk_size, limit=args.limit,
        model_name=args.model or "smollm2-135m", progress=not args.no_progress,
    )  # fmt: skip
    if state is None or state.is_main_process:
        print(f"{len(records)} results in {time.perf_counter() - start:.0f} s; see {args.out}/summary.md")
    return 0
