"""`hf-kvcompress eval`: long-context tasks x cache methods, document first, question after compression.

Results append to OUT/results.jsonl (a rerun skips finished method/sample pairs); OUT/summary.md, summary.csv,
heatmap_<method>.png and quality_vs_memory.png are rewritten at the end, covering every method in OUT whose results
match this run's samples and settings (earlier runs' methods included). A result is reused only when every
setting that changes it matches (model, dtype, device kind, cache spec and what it resolves to on the model,
protocol, prompt format, chunk size, batch size, max new tokens, the sample's tokens, package version). Split the
samples over processes with `accelerate launch --multi_gpu --num_processes N -m hf_kvcompress.eval ARGS` (on GPUs
or, without one, on CPU cores) or `torchrun --nproc_per_node N -m hf_kvcompress.eval ARGS`; `accelerate launch
--cpu` starts one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..extras import require
from .checks import check_device


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
    parser.add_argument("--model", default=None,
                        help="alias, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--methods", default="dynamic",
                        help='comma-separated cache specs, e.g. "dynamic,int4,sink_window:window=256,h2o:budget=256"; '
                             "dynamic (uncompressed) is always added as the baseline")  # fmt: skip
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks: needle, multi_needle, kv_retrieval, doc_qa, multi_question, "
                             "user_needle, user_recall; parameters as in needle:kind=passkey or "
                             "multi_needle:keys=4,values=2 "
                             "(default: needle, plus user_needle,user_recall with --documents)")  # fmt: skip
    parser.add_argument("--lengths", type=_ints, default=[1000, 2000, 3000],
                        help="prompt lengths in the model's tokens (default 1000,2000,3000)")
    parser.add_argument("--depths", type=_floats, default=[0, 25, 50, 75, 100],
                        help="depths in percent of the document (default 0,25,50,75,100)")
    parser.add_argument("--samples", type=int, default=1, help="samples per (task, length, depth) cell (default 1)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many samples per task (quick runs)")
    parser.add_argument("--seed", type=int, default=0, help="sample generation seed (default 0); decoding is greedy")
    parser.add_argument("--split", choices=("dev", "test", "all"), default="test",
                        help="which half of each cell's samples: test (the default: the half to report), dev (the "
                             "half to tune methods and defaults on) or all (both); --samples counts that "
                             "half's")  # fmt: skip
    parser.add_argument("--documents", default=None,
                        help="a folder of .txt, .md, .jsonl files for user_needle and user_recall")
    parser.add_argument("--query-aware", action="store_true",
                        help="also put the question before the document, inside the compressed prompt")
    parser.add_argument("--prompt-format", choices=("auto", "chat", "plain"), default="auto",
                        help="chat: the tokenizer's chat template; plain: 'document, question, answer' (auto: chat "
                             "if the tokenizer has one)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=1,
                        help="samples per forward pass, left-padded; rows share a task and question length "
                             "(default 1)")  # fmt: skip
    parser.add_argument("--chunk-size", type=int, default=512,
                        help="prefill chunk for methods with bounded memory (default 512)")
    parser.add_argument("--device", default=None,
                        help="default: cuda if available, else cpu (per process under accelerate)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--out", required=True,
                        help="output folder: results.jsonl, summary.md/.csv, plots, data/ (required)")
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


def check_arguments(args) -> tuple[list[str], list[str]]:
    """(tasks, methods) with every spec parsed and every size checked: bad input fails before the model loads."""
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from ..eval.data import read_user_documents
    from ..eval.runner import check_specs
    from ..eval.tasks import parse_task, split_specs

    if args.tasks is None:
        tasks = ["needle"] + (["user_needle", "user_recall"] if args.documents else [])
    else:
        tasks = split_specs(args.tasks)
    for task in tasks:
        parse_task(task, args.documents)
    if args.documents is not None:
        read_user_documents(args.documents)  # a missing folder or a binary file fails before the model loads
    methods = split_specs(args.methods)
    check_specs(methods)
    if not args.lengths or any(n < 1 for n in args.lengths):
        raise ValueError(f"--lengths takes positive numbers of tokens, got {args.lengths}")
    if not args.depths or any(not 0 <= d <= 100 for d in args.depths):
        raise ValueError(f"--depths are percents of the document, 0 to 100, got {args.depths}")
    for flag, value in (("--samples", args.samples), ("--limit", args.limit), ("--batch-size", args.batch_size),
                        ("--chunk-size", args.chunk_size)):  # fmt: skip
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    check_device(args.device)
    return tasks, methods


def run(args) -> int:
    require("eval", "hf-kvcompress eval")  # before any of the eval extra's modules is imported
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from ..eval.runner import check_context, distributed_state, run_eval
    from ..models import load_config, load_model

    tasks, methods = check_arguments(args)
    check_context(load_config(args.model), args.lengths)  # before the weights load
    state = distributed_state()
    if state is None and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
        print("note: `accelerate launch --cpu` starts a single process; to split the samples use "
              "`accelerate launch --multi_gpu --num_processes N` (CPU processes without a GPU) or `torchrun`",
              file=sys.stderr)  # fmt: skip
    device = args.device or (str(state.device) if state is not None else None)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device, dtype=args.dtype)
    counts: dict = {}
    records = run_eval(
        model, tokenizer, methods, tasks, args.lengths, args.depths, args.out,
        samples_per_cell=args.samples, seed=args.seed, split=args.split, documents=args.documents,
        query_aware=args.query_aware,
        prompt_format=args.prompt_format, batch_size=args.batch_size, chunk_size=args.chunk_size, limit=args.limit,
        model_name=args.model or "smollm2-135m", progress=not args.no_progress, counts=counts,
    )  # fmt: skip
    if state is None or state.is_main_process:
        processes = f" over {state.num_processes} processes" if state is not None else ""
        print(f"{len(records)} results ({counts['to_run']} evaluated now{processes}, {counts['reused']} reused from "
              f"earlier runs with the same settings) in {time.perf_counter() - start:.0f} s; see {args.out}/summary.md")
    return 0
