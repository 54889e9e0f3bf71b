"""The study's shared prefill: a plan's cache rebuilt from one DynamicCache prefill holds the same bytes and answers
exactly as a cache that was given the document itself (one chunk), for every family of the demo's plans:
quantization, eviction, sharing, low rank and their stacks. (Within one prefill step a compressed cache attends to
the step's own states at full precision, so encoding the finished full-precision cache gives the same cache.)"""

import pytest
import torch

from hf_kvcompress.eval.runner import left_pad, run_batch
from hf_kvcompress.generation import generate
from hf_kvcompress.measure import measured_kv_bytes
from hf_kvcompress.shared_prefill import document_states, replay, replay_and_rescore, rescores

from .caches.tiny_models import tiny_model

PLANS = ["dynamic", "int4:group_size=16,residual_length=4", "int8:group_size=16,residual_length=2", "fp8",
         "sink_window:sink_tokens=2,window=8", "shared_heads",
         "sink_window:sink_tokens=2,window=8+shared_heads+int8:group_size=16,residual_length=2",
         "shared_heads+int8:group_size=16,residual_length=2", "lowrank:rank=8,bases={bases}",
         "lowrank:rank=16,bases={bases}+int8:group_size=16,residual_length=2"]


def _bases(model, tmp_path):
    from hf_kvcompress.calibration import calibrate, save_bases

    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate(model, ids, max_rank=16, text="random ids")
    return save_bases(tensors, metadata, tmp_path).parent


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_replayed_caches_answer_as_a_real_prefill(family, tmp_path):
    model = tiny_model(family)
    model.config._name_or_path = f"tiny-{family}"
    bases = _bases(model, tmp_path)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 128, (n,), generator=g).tolist(), torch.randint(3, 128, (4,), generator=g).tolist())
            for n in (20, 17)]
    full_ids, full_mask, width = left_pad(rows, 0)
    reference = document_states(model, full_ids, full_mask, width)
    for plan in (p.format(bases=bases) for p in PLANS):
        if family == "gemma3" and "shared_heads" in plan:
            continue  # one KV head: refused (tested in tests/caches/test_shared_heads_cache.py)
        real = run_batch(model, plan, rows, 6, pad_token_id=0, chunk_size=None)
        cache = replay(plan, model, reference, full_mask[:, :width])
        assert measured_kv_bytes(cache) == real.kv_bytes_document, plan
        got = generate(model, full_ids, full_mask, cache, max_new_tokens=6).new_tokens.tolist()
        assert got == real.new_tokens, plan



KVZIP = ["kvzip:ratio=0.5", "kvzip:ratio=0.25+int4:group_size=16,residual_length=4", "kvzip:budget=12",
         "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=0.5,budgets=uniform+int8:group_size=16,residual_length=2"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kvzip_from_the_shared_prefill_answers_as_its_own_prefill(family):
    """Issue 25.9: KVzip joins the demo from the shared prefill, paying only its reconstruction pass."""
    from hf_kvcompress.eval.runner import AttentionSwitch

    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 128, (n,), generator=g).tolist(), torch.randint(3, 128, (4,), generator=g).tolist())
            for n in (40, 40)]
    full_ids, full_mask, width = left_pad(rows, 0)
    reference = document_states(model, full_ids, full_mask, width)
    repeat = [5, 6, 7]
    for plan in KVZIP:
        assert rescores(plan)
        real = run_batch(model, plan, rows, 6, pad_token_id=0, chunk_size=None, repeat_prompt_ids=repeat)
        with AttentionSwitch(model, plan), torch.inference_mode():
            cache = replay_and_rescore(plan, model, reference, full_ids[:, :width], full_mask[:, :width], repeat)
            assert measured_kv_bytes(cache) == real.kv_bytes_document, plan
            got = generate(model, full_ids, full_mask, cache, max_new_tokens=6).new_tokens.tolist()
        assert got == real.new_tokens, plan
    assert not rescores("h2o:budget=128") and not rescores("snapkv:budget=128") and not rescores("int4")


def test_the_study_batches_no_padded_rows():
    """Issue 25.9: `make demo` warned that per-channel key groups span left padding (documents of 2,003-2,008
    tokens shared batches); rows now batch only with documents of their own length."""
    from hf_kvcompress.eval.runner import plan_batches
    from hf_kvcompress.shared_prefill import batch_groups

    rows = [{"task": "needle", "max_new_tokens": 10}] * 6
    encoded = [([1] * n, [2] * 40) for n in (2008, 2007, 2008, 2003, 2008, 2007)]
    batches = plan_batches(["all"], encoded, [str(i) for i in range(6)], 5, None, groups=batch_groups(rows, encoded))
    assert sorted(sorted(len(encoded[i][0]) for i in b.rows) for b in batches) == [[2003], [2007, 2007],
                                                                                   [2008, 2008, 2008]]


def test_a_replayed_quantized_cache_reads_its_store_at_decode_without_a_false_note():
    # shared_prefill.replay fills a cache with no attention after the update: its prompt probe goes unanswered.
    # That must not say "the model does not run kvcompress_sdpa" (the study printed it for int8/int4), and the
    # decode steps that follow must still read the store through the fast path.
    import warnings

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    cache = replay("int4:residual_length=8,group_size=8", model, document_states(model, ids, mask, 40), mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(input_ids=torch.cat([ids, ids[:, :3]], -1), attention_mask=torch.ones(1, 43, dtype=torch.long),
                       cache=cache, max_new_tokens=4, do_sample=False)
    assert not [w for w in caught if "does not run" in str(w.message)]
    assert all(layer.offers.confirmed for layer in cache.layers)
