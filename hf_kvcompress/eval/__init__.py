"""The long-context evaluation suite: tasks built from real text, the document-first protocol, scores and reports.

    from hf_kvcompress.eval import run_eval, summarize
    records = run_eval(model, tokenizer, ["int4", "sink_window:window=256"], tasks=["needle"],
                       lengths=[1000, 2000], depths=[0, 50, 100], out_dir="runs/needle")
    summarize(records)["ranking"]

`hf-kvcompress eval` is the command line; `accelerate launch --multi_gpu --num_processes N -m hf_kvcompress.eval
...` or `torchrun --nproc_per_node N -m hf_kvcompress.eval ...` splits the samples between processes. lm-eval users get the same tasks (eval_tasks/kvc_*) and model (`hf-kvcompress`) through
`hf-kvcompress lm-eval`.
"""

from .prompts import encode, protocol_name, render
from .report import summarize, write_reports
from .runner import read_results, run_batch, run_eval
from .tasks import TASKS, build_samples, parse_task

__all__ = [
    "TASKS",
    "build_samples",
    "encode",
    "parse_task",
    "protocol_name",
    "read_results",
    "render",
    "run_batch",
    "run_eval",
    "summarize",
    "write_reports",
]
