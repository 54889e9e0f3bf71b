"""Writes the head-budget cache files test_persist.py loads, with the answers the code that wrote them gave.

Run from the repository root: python tests/caches/data/make_head_budget_files.py tests/caches/data
"""
import json
import sys

import torch

sys.path.insert(0, ".")
from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, save_cache, use_kvcompress_attention
from hf_kvcompress.generation import generate, prefill
from tests.caches.tiny_models import tiny_model

out = sys.argv[1]
CASES = {
    "llama": ("kvzip:ratio=0.5,budgets=head+int4:residual_length=4,group_size=16", 2),
    "gemma3": ("kvzip:ratio=0.5", 1),
}
for name, (spec, batch) in CASES.items():
    model = use_kvcompress_attention(tiny_model(name))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (batch, 30), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :7] = 0
        ids[0, :7] = 0
    cache = make_cache(spec, model.config)
    prefill(model, ids, mask, cache, repeat_prompt_ids=[5, 6, 7])
    question = torch.randint(3, 128, (batch, 3), generator=g)
    # The question joins unscored (recent tokens beside the ranked store), as a saved conversation holds it.
    ids = torch.cat([ids, question], 1)
    mask = torch.cat([mask, torch.ones_like(question)], 1)
    prefill(model, question, mask, cache, compress=False)
    answer = torch.randint(3, 128, (batch, 2), generator=g)
    full = torch.cat([ids, answer], 1)
    full_mask = torch.cat([mask, torch.ones_like(answer)], 1)
    path = f"{out}/head_budgets_{name}.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    tokens = generate(model, full, full_mask, loaded, max_new_tokens=6).new_tokens
    expected = {"ids": full.tolist(), "mask": full_mask.tolist(), "new_tokens": tokens.tolist(),
                "bytes_loaded": measured_kv_bytes(load_cache(path)), "bytes_after": measured_kv_bytes(loaded),
                "promised_after": loaded.promised_kv_bytes(), "stored_tokens_after": loaded.stored_tokens,
                "seq_length_after": loaded.get_seq_length()}
    save_cache(cache, path, metadata={"expected": json.dumps(expected)})
    print(name, spec, expected["new_tokens"], expected["bytes_loaded"], expected["bytes_after"])
