"""KVzip's cost as a ratio to one plain prefill: CPU time of this process, one thread (the machine is shared).

Question: how many plain prefills does KVzip's prefill (with its reconstruction pass) cost?
Command:
    python benchmarks/probes/kvzip_cost.py smollm2-135m 2000
Written up: docs/results.md, "Eviction policies side by side (question
after the document)" (the cost of the reconstruction pass).
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention

SPECS = ["dynamic", "kvzip:ratio=0.25"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model alias or path, e.g. smollm2-135m")
    parser.add_argument("length", type=int, help="prompt tokens (random ids, seed 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared: one thread's CPU time is what the neighbours disturb least
    model, tokenizer = load_model(args.model)
    use_kvcompress_attention(model)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0))
    repeat = repeat_prompt_ids(tokenizer)
    for _ in range(2):
        for spec in SPECS:
            cache = make_cache(spec, model.config)
            start = time.process_time()
            prefill(model, ids, None, cache, repeat_prompt_ids=repeat)
            print(args.model, args.length, spec, f"cpu {time.process_time() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
