"""Where the study's time goes: the shared document prefill, and each plan's own work, per sample.

Question: how many CPU seconds per sample do the study's shared document prefill and each plan's own work take?
Command:
    python benchmarks/probes/study_pace.py smollm2-135m 2000 3 [max_new_tokens] ["plan;plan;..."]
Written up: docs/study.md, "The study (`make demo`)", "Where the time went, and what made it fit".

CPU seconds of this process (the machine is shared, so wall time is inflated by the neighbours' load) and wall
seconds, for one batch of needle samples. The load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hf_kvcompress.eval.prompts import encode
from hf_kvcompress.eval.runner import AttentionSwitch, left_pad, run_batch
from hf_kvcompress.eval.tasks import build_samples
from hf_kvcompress.generation import generate, repeat_prompt_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.registry import needs_own_prefill
from hf_kvcompress.shared_prefill import document_states, replay, replay_and_rescore, rescores
from hf_kvcompress.study import study_plans


def clock(fn):
    """(fn(), wall seconds, CPU seconds of this process)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model alias or path, e.g. smollm2-135m")
    parser.add_argument("length", type=int, help="needle document length in tokens")
    parser.add_argument("batch", type=int, help="needle samples in the batch")
    parser.add_argument("max_new_tokens", type=int, nargs="?", default=16)
    parser.add_argument("plans", nargs="?", default=None, help="plans separated by ';' (default: the study's plans)")
    args = parser.parse_args()
    name, length, batch, max_new = args.model, args.length, args.batch, args.max_new_tokens
    model, tok = load_model(name)
    plans = args.plans.split(";") if args.plans else study_plans([length], model.config)
    samples = build_samples(tok, ["needle"], [length], [10, 50, 90][:batch] + [30] * max(0, batch - 3),
                            samples_per_cell=1, seed=0)
    encoded = [encode(tok, r, query_aware=False) for r in samples]
    ids, mask, width = left_pad(encoded, tok.pad_token_id or 0)
    print(f"{name}: {batch} samples of {ids.shape[1]} tokens, max_new_tokens={max_new}, "
          f"threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}", flush=True)

    ref, w, c = clock(lambda: document_states(model, ids, mask, width))
    print(f"{'shared prefill':50s} cpu {c / batch:7.2f} s/sample  wall {w / batch:7.2f} s/sample", flush=True)
    rp = repeat_prompt_ids(tok)
    for plan in plans:
        if rescores(plan):  # KVzip, as the study runs it: the replayed states, then its reconstruction pass
            def fn(plan=plan):
                with AttentionSwitch(model, plan), torch.no_grad():
                    cache = replay_and_rescore(plan, model, ref, ids[:, :width], mask[:, :width], rp)
                    return generate(model, ids, mask, cache, max_new_tokens=max_new)
        elif needs_own_prefill(plan):
            def fn(plan=plan):
                return run_batch(model, plan, encoded, max_new, pad_token_id=tok.pad_token_id or 0, chunk_size=None,
                                 repeat_prompt_ids=rp)
        else:
            def fn(plan=plan):
                return generate(model, ids, mask, replay(plan, model, ref, mask[:, :width]), max_new_tokens=max_new)
        _, w, c = clock(fn)
        print(f"{plan:50s} cpu {c / batch:7.2f} s/sample  wall {w / batch:7.2f} s/sample  "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
