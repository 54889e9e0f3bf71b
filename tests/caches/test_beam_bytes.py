"""Beam search reorders a cache's rows after every step (`reorder_cache`): what the cache then holds is what it
promises, for every codec (no tensor of the rows before the reorder is kept alive beside the new ones)."""

import pytest

from hf_kvcompress import make_cache, measured_kv_bytes

from ..codecs.lowrank_tiny import llama_with_bases, with_bases
from .tiny_models import left_padded_prompts

# Every registry codec, with residuals short enough that the prompts below are encoded and decode steps encode more.
CODECS = [
    "dynamic",
    "fp8",
    "int8:residual_length=8",
    "int4:residual_length=8,group_size=8",
    "int3:residual_length=8",
    "int2",
    "int2:residual_length=8,key_axis=token",
    "lowrank:ratio=0.5",
    "lowrank:ratio=0.5+int4:residual_length=0,key_axis=token",
    "shared_heads:heads_per_group=2+int8:residual_length=8",
    "h2o:budget=24,recent=4+int2:residual_length=8",
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_with_bases(tmp_path_factory)


@pytest.mark.parametrize("spec", CODECS)
def test_a_beam_reorder_holds_what_it_promises(llama, spec):
    model, bases = llama
    cache = make_cache(with_bases(bases, spec), model.config)
    gaps = []
    reorder = cache.reorder_cache

    def checked(beam_idx):
        reorder(beam_idx)
        gaps.append(measured_kv_bytes(cache) - cache.promised_kv_bytes())

    cache.reorder_cache = checked  # every reorder generate makes, as it makes it
    _, ids, mask = left_padded_prompts(lengths=(131, 163))  # padding of 32: whole per-channel key groups
    model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, num_beams=2)
    assert len(gaps) >= 5
    assert gaps == [0] * len(gaps)
