"""A window that slides one token per decode step (sink_window) drops its slot in place (`TokenStore.slide`): it answers
as the per-step gather it replaces, holds exactly the room it counts, and survives saves, beams and resets."""

import copy

import pytest
import torch

from hf_kvcompress import load_cache, make_cache, measured_kv_bytes, save_cache
from hf_kvcompress.caches import storage
from hf_kvcompress.caches.eviction import Eviction

from .tiny_models import left_padded_prompts, tiny_model

SPECS = ["sink_window:sink_tokens=2,window=32", "sink_window:sink_tokens=0,window=35",
         "sink_window:sink_tokens=4,window=40"]


def _gather_path(monkeypatch):
    """The eviction before slides: every decode step gathers the kept slots (`drop_one`, `TokenStore.take`)."""
    monkeypatch.setattr(Eviction, "slides", lambda *args, **kwargs: False)


def _scores(model, spec, ids, mask, steps, **kwargs):
    cache = make_cache(spec, model.config)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=steps, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, **kwargs)
    return torch.stack(out.scores), out.sequences, cache


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_batch_answers_as_the_gather_did(monkeypatch, name, spec, dtype):
    model = tiny_model(name).to(dtype)
    _, ids, mask = left_padded_prompts(lengths=(20, 41, 33))
    slid, tokens, cache = _scores(model, spec, ids, mask, 40)
    # Gemma-3's sliding layers keep 5 tokens: too few for a room, they gather as before (`can_slide`).
    assert [layer.store._room is not None for layer in cache.layers] == [not layer.is_sliding for layer in cache.layers]
    with monkeypatch.context() as patch:
        _gather_path(patch)
        gathered, reference, old = _scores(model, spec, ids, mask, 40)
    assert all(layer.store._room is None for layer in old.layers)
    assert torch.equal(tokens, reference)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(slid, gathered, rtol=0, atol=tolerance)
    assert [layer.stored_tokens for layer in cache.layers] == [layer.stored_tokens for layer in old.layers]


def test_a_steady_step_gathers_nothing_and_copies_the_window_once_per_room(monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0))
    cache = make_cache("sink_window:sink_tokens=4,window=60", model.config)
    model(ids, cache=cache, position_ids=torch.arange(70).expand(2, -1))  # evicted to the budget by select_kept
    monkeypatch.setattr(storage, "gather_states", lambda *a: pytest.fail("a decode step gathered the kept slots"))
    layer = cache.layers[0]
    token, rooms = ids[:, -1:], []
    for step in range(12):
        position = torch.full((2, 1), 70 + step)
        token = model(token, cache=cache, position_ids=position).logits[:, -1:].argmax(-1)
        rooms.append(layer.store._room[0].untyped_storage().data_ptr())
        assert layer.stored_tokens == 64
    # 64 kept slots, room for two more slides: a fresh room at the first of every three steps
    assert [rooms[i] != rooms[i - 1] for i in range(1, 12)] == [False, False, True] * 3 + [False, False]
    assert layer.store._room[0].shape[-2] == 64 + 1 + 2


@pytest.mark.parametrize("steps", [2, 3, 4, 8])  # decode steps + 1: a fresh room, then slides
def test_the_room_is_counted_whole_and_a_saved_cache_goes_on_alike(tmp_path, steps):
    model = tiny_model("llama")
    _, ids, mask = left_padded_prompts(lengths=(30, 45))
    cache = make_cache("sink_window:sink_tokens=2,window=40", model.config)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=steps, do_sample=False,
                         return_dict_in_generate=True)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    assert cache.layers[0].store._room is not None
    assert cache.layers[0].tail_keys.shape[-2] == 42  # a pending slide is made before the tail is read
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors")
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes() < measured_kv_bytes(cache)  # no room yet
    sequences = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, steps, dtype=mask.dtype)], dim=1)
    a = model.generate(sequences, attention_mask=full_mask, cache=copy.deepcopy(cache), max_new_tokens=9,
                       do_sample=False, output_scores=True, return_dict_in_generate=True)
    b = model.generate(sequences, attention_mask=full_mask, cache=loaded, max_new_tokens=9, do_sample=False,
                       output_scores=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=0, atol=1e-5)


def test_beams_and_a_reset_answer_as_the_gather_did(monkeypatch):
    model = tiny_model("llama")
    _, ids, mask = left_padded_prompts(lengths=(28, 34))
    spec = "sink_window:sink_tokens=2,window=30"
    slides = []
    slide = storage.TokenStore.slide
    monkeypatch.setattr(storage.TokenStore, "slide", lambda self, *a: slides.append(1) or slide(self, *a))
    slid, tokens, cache = _scores(model, spec, ids, mask, 30, num_beams=3)
    assert slides  # beams reorder rows every step, so each slide takes a fresh room
    with monkeypatch.context() as patch:
        _gather_path(patch)
        gathered, reference, _ = _scores(model, spec, ids, mask, 30, num_beams=3)
    assert torch.equal(tokens, reference)
    torch.testing.assert_close(slid, gathered, rtol=0, atol=1e-5)
    cache.reset()
    again = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=30, do_sample=False, num_beams=3)
    assert torch.equal(again, tokens)
