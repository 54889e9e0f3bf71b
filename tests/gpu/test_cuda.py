"""On a GPU, what a user runs: `model.generate(cache=...)` on CUDA in bf16, fp16 and fp32.

Skipped without CUDA (CI has none; the CPU suite covers the same contracts there, with the Triton kernel in Triton's
interpreter). Run where a GPU is lent: `pytest tests/gpu tests/ops/test_triton_decode.py`."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import make_cache
from hf_kvcompress.caches import store_attention
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.registry import parse_spec

from ..caches.tiny_models import attend_per_head, kvzip_forced_logits, left_padded_prompts, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Caches that keep every token of these short prompts: they must answer as DynamicCache does, token for token.
KEEP_ALL = ["sink_window:sink_tokens=4,window=4096", "h2o:budget=4096,recent=8", "snapkv:budget=4096"]


def _on_gpu(name: str, dtype: torch.dtype):
    return tiny_model(name).to("cuda", dtype)


def _greedy(model, ids, mask, cache, new=12):
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", KEEP_ALL)
def test_caches_that_keep_everything_answer_as_dynamic_cache(spec, name, dtype):
    _, ids, mask = left_padded_prompts(seed=1, lengths=(9, 30, 17))
    ids, mask = ids.cuda(), mask.cuda()
    reference = _greedy(_on_gpu(name, dtype), ids, mask, DynamicCache())
    model = _on_gpu(name, dtype)
    tokens, logits = _greedy(model, ids, mask, make_cache(spec, model.config))
    assert torch.equal(tokens, reference[0]), (spec, name, dtype)
    # Attention-scored policies attend through the package's function (statistics gathered as it attends): the
    # same softmax in another order, so logits agree to the dtype's rounding, not bit for bit.
    scale = reference[1].abs().max()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (logits - reference[1]).abs().max() <= tolerance * scale, (spec, name, dtype)


def _decode(model, ids, mask, cache, steps: int, tokens=None):
    """Prefill `ids` then decode `steps` tokens one forward at a time, positions from the mask as `generate` sets
    them: the given `tokens` [B, steps] (teacher-forced) or greedy ones. Returns (logits [steps, B, V], the last
    step's inputs) so a caller can run one more step itself."""
    out = []
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache).logits[:, -1]
        for step in range(steps):
            out.append(logits.float())
            token = logits.argmax(-1, keepdim=True) if tokens is None else tokens[:, step:step + 1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = mask.sum(-1, keepdim=True) - 1
            logits = model(input_ids=token, attention_mask=mask, position_ids=position, cache=cache).logits[:, -1]
    token = logits.argmax(-1, keepdim=True)
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return torch.stack(out), dict(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["int4:residual_length=8,group_size=8", "int8:residual_length=8,group_size=8"])
def test_quantized_caches_read_their_store_with_the_triton_kernel(spec, dtype, store_reads, monkeypatch):
    """The user's path on CUDA reads the packed store with the Triton kernel, and its logits are those of the
    PyTorch path over the same store (teacher-forced on the kernel's tokens, so a near tie cannot fork them)."""
    _, ids, mask = left_padded_prompts(seed=2, lengths=(40, 33))
    ids, mask = ids.cuda(), mask.cuda()
    model = _on_gpu("llama", dtype)
    tokens, _ = _greedy(model, ids, mask, make_cache(spec, model.config))
    steps = tokens[:, ids.shape[1]:]
    assert store_reads and set(store_reads) == {"triton"}, store_reads
    kernel, _ = _decode(model, ids, mask, make_cache(spec, model.config), steps.shape[1], steps)
    original = store_attention.attend_store
    monkeypatch.setattr("hf_kvcompress.caches.layer.attend_store",
                        lambda layer, query, mask, scaling, backend="auto": original(layer, query, mask, scaling,
                                                                                     "torch"))
    torch_path, _ = _decode(model, ids, mask, make_cache(spec, model.config), steps.shape[1], steps)
    assert kernel.isfinite().all()
    scale = torch_path.abs().max()
    tolerance = 5e-3 if dtype == torch.float32 else 3e-2  # the kernel's dots run in tf32
    assert (kernel - torch_path).abs().max() <= tolerance * scale, (spec, dtype)


def _syncs(fn, **kwargs) -> int:
    """How many synchronizing CUDA calls (host reads of device values, blocking copies) `fn(**kwargs)` makes."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(**kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_the_sync_count_sees_a_host_read():
    values = torch.ones(3, device="cuda")
    assert _syncs(values.sum().item) >= 1 and _syncs(torch.add, input=values, other=values) == 0


@pytest.mark.parametrize("spec", [
    "int4:residual_length=8,group_size=8", "int2:residual_length=8,group_size=8", "fp8",
    "sink_window:sink_tokens=4,window=24", "h2o:budget=24,recent=4", "snapkv:budget=24,window=4,recent=4",
])
def test_a_steady_decode_step_adds_no_host_syncs_to_transformers_own(spec):
    """A decode step with the compressed cache makes no more synchronizing calls than the same step with
    DynamicCache (transformers' own step may make some; ours must add none), counted by CUDA's sync debug mode."""
    _, ids, mask = left_padded_prompts(seed=3, lengths=(40, 52))
    ids, mask = ids.cuda(), mask.cuda()
    counts = {}
    for label, build in (("dynamic", lambda m: DynamicCache()), (spec, lambda m: make_cache(spec, m.config))):
        model = _on_gpu("llama", torch.bfloat16)
        cache = build(model)
        _, step = _decode(model, ids, mask, cache, 40)  # past the residual's fills, encodings and evictions
        with torch.inference_mode():
            counts[label] = _syncs(model, **step, cache=cache)
    assert counts[spec] <= counts["dynamic"], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slack", [None, 0])  # None: GROUP_SLACK; 0: each layer's heads in one masked call
def test_per_head_stores_attend_in_groups_as_one_call_per_head(dtype, slack, monkeypatch):
    """KVzip's per-head store on CUDA: heads of close lengths attend in one SDPA call over a strided view with the
    gaps masked (caches/joined_heads.py); the logits equal one call per head over the same store, teacher-forced,
    on a left-padded batch."""
    from hf_kvcompress.caches import joined_heads

    _, ids, mask = left_padded_prompts(seed=5, lengths=(60, 90, 75))
    ids, mask = ids.cuda(), mask.cuda()
    tokens = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(6)).cuda()
    monkeypatch.setattr(joined_heads, "GROUP_SLACK", 0 if slack == 0 else joined_heads.GROUP_SLACK)
    model = _on_gpu("llama", dtype)

    def exact_pairs():  # the ratio's own plan: a plain quarter is its byte target in int4 (caches/plan.py)
        return CompressedCache(*parse_spec("kvzip:ratio=0.25"), config=model.config, ratio_bytes=False)

    grouped = kvzip_forced_logits(model, ids, mask, exact_pairs(), tokens)
    monkeypatch.setattr(joined_heads.JoinedHeads, "attend", attend_per_head)
    reference = kvzip_forced_logits(model, ids, mask, exact_pairs(), tokens)
    scale = reference.abs().max()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert grouped.isfinite().all() and (grouped - reference).abs().max() <= tolerance * scale
