"""KVzip's cost as a ratio to one plain prefill: CPU time of this process, one thread (the machine is shared).

Usage: python benchmarks/kvzip_cost.py smollm2-135m 2000
"""
import sys, time, torch
torch.set_num_threads(1)
from hf_kvcompress import load_model, make_cache, prefill, repeat_prompt_ids, use_kvcompress_attention
name, n = sys.argv[1], int(sys.argv[2])
model, tok = load_model(name)
use_kvcompress_attention(model)
ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(0))
rp = repeat_prompt_ids(tok)
for rep in range(2):
    for spec in ["dynamic", "kvzip:ratio=0.25"]:
        c = make_cache(spec, model.config)
        t = time.process_time()
        prefill(model, ids, None, c, repeat_prompt_ids=rp)
        print(name, n, spec, f"cpu {time.process_time() - t:.2f} s", flush=True)
