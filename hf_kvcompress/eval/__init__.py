"""The long-context evaluation suite: tasks built from real text, the document-first protocol, scores and reports.

    from hf_kvcompress.eval import run_eval, summarize
    records = run_eval(model, tokenizer, ["int4", "sink_window:window=256"], tasks=["needle"],
                       lengths=[1000, 2000], depths=[0, 50, 100], out_dir="runs/needle")
    summarize(records)["ranking"]

`hf-kvcompress eval` is the command line; `accelerate launch --multi_gpu --num_processes N -m hf_kvcompress.eval
...` or `torchrun --nproc_per_node N -m hf_kvcompress.eval ...` splits the samples between processes. lm-eval users
get the same tasks (eval_tasks/kvc_*) and model (`hf-kvcompress`) through `hf-kvcompress lm-eval`.
"""

import importlib

# Each public name and its module, imported on first use (PEP 562): `hf-kvcompress lm-eval --help` and `python -m
# hf_kvcompress.eval --help` read no torch.
_EXPORTS = {
    ".prompts": ["encode", "protocol_name", "render"],
    ".report": ["summarize", "write_reports"],
    ".runner": ["read_results", "run_batch", "run_eval"],
    ".tasks": ["SPLITS", "TASKS", "build_samples", "parse_task", "sample_split"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_MODULE_OF)
