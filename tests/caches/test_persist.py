"""Saved caches: the same bytes and the same answers after loading, and a clear error for another model."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from hf_kvcompress import (
    SinkWindowCache,
    load_cache,
    make_cache,
    measured_kv_bytes,
    save_cache,
    use_kvcompress_attention,
)
from hf_kvcompress.generation import generate, prefill

from ..codecs.lowrank_tiny import llama_with_bases, with_bases
from .tiny_models import assert_same_state, tiny_model

DATA = Path(__file__).parent / "data"

SPECS = ["dynamic", "int4:residual_length=4,group_size=8", "fp8", "int2:group_size=16,residual_length=0",
         "int4:key_axis=token,residual_length=4", "int2:key_axis=token,residual_length=0",
         "sink_window:sink_tokens=2,window=6+int8:residual_length=2", "h2o:budget=8,recent=3",
         "expected_attention:ratio=0.5,window=4"]


def _document(batch=2, length=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # a padded row travels too
    return ids, mask


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", SPECS)
def test_loaded_cache_holds_the_same_bytes_and_answers_the_same(tmp_path, name, spec):
    model = use_kvcompress_attention(tiny_model(name))
    ids, mask = _document()
    cache = make_cache(spec, model.config)
    prefill(model, ids, mask, cache, chunk_size=11)
    save_cache(cache, tmp_path / "doc.safetensors")
    loaded = load_cache(tmp_path / "doc.safetensors")
    assert_same_state(cache, loaded)
    # The file holds the stored tokens, not the spare slots of the encoded store's room (caches/encoded_room.py)
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes()
    assert measured_kv_bytes(loaded) <= measured_kv_bytes(cache) == cache.promised_kv_bytes()
    held = [layer for layer in loaded.layers if layer.n_encoded]
    assert all(getattr(layer.store, "encoded_slots", 0) == layer.n_encoded for layer in held)
    assert loaded.spec == cache.spec
    for seed in (1, 2):  # two questions about the same document, each from a fresh copy
        question = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(seed))
        full = torch.cat([ids, question], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(question)], dim=1)
        a = generate(model, full, full_mask, copy.deepcopy(cache), max_new_tokens=6).new_tokens
        b = generate(model, full, full_mask, load_cache(tmp_path / "doc.safetensors"), max_new_tokens=6).new_tokens
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def llama_bases(tmp_path_factory):
    return llama_with_bases(tmp_path_factory)


@pytest.mark.parametrize("spec", ["lowrank:residual_length=4", "lowrank:ratio=0.5",
                                  "lowrank:ratio=0.5+int4:residual_length=0,key_axis=token",
                                  "lowrank:residual_length=4+int8:residual_length=0,key_axis=token"])
def test_a_low_rank_cache_loads_and_answers_the_same(tmp_path, llama_bases, spec):
    """Joint bases store keys before RoPE: the saved positions are part of the state, and loading decodes the keys
    at them (the readability check too)."""
    model, bases = llama_bases
    ids, mask = _document()
    cache = make_cache(with_bases(bases, spec), model.config)
    prefill(model, ids, mask, cache, chunk_size=11)
    assert all(layer.n_encoded for layer in cache.layers)
    save_cache(cache, tmp_path / "doc.safetensors")
    loaded = load_cache(tmp_path / "doc.safetensors")
    assert_same_state(cache, loaded)
    assert loaded.spec == cache.spec
    question = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    full = torch.cat([ids, question], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(question)], dim=1)
    a = generate(model, full, full_mask, copy.deepcopy(cache), max_new_tokens=6).new_tokens
    b = generate(model, full, full_mask, loaded, max_new_tokens=6).new_tokens
    assert torch.equal(a, b)


def test_rerotating_cache_round_trips(tmp_path):
    model = tiny_model("llama")
    cache = SinkWindowCache(sink_tokens=2, window=6, config=model.config, rerotate=True)
    ids, mask = _document(seed=3)
    prefill(model, ids, mask, cache)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors", device="cpu")
    assert_same_state(cache, loaded)
    assert loaded.rerotate and loaded.layers[0].inv_freq is not None


def test_another_model_is_refused(tmp_path):
    model = tiny_model("llama")
    cache = make_cache("int8", model.config)
    ids, mask = _document(seed=4)
    prefill(model, ids, mask, cache)
    save_cache(cache, tmp_path / "c.safetensors")
    other = tiny_model("qwen2")
    with pytest.raises(ValueError, match="saved from"):
        load_cache(tmp_path / "c.safetensors", model=other)
    loaded = load_cache(tmp_path / "c.safetensors")
    full = torch.cat([ids, ids[:, :3]], dim=1)
    with pytest.raises(ValueError, match="saved from"):
        generate(other, full, None, loaded, max_new_tokens=2)
    generate(model, full, None, loaded, max_new_tokens=2)  # the model it came from is accepted


def test_save_refuses_what_it_cannot_restore(tmp_path):
    with pytest.raises(ValueError, match="config"):
        save_cache(make_cache("int8"), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="empty"):
        save_cache(make_cache("int8", tiny_model("llama").config), tmp_path / "x.safetensors")
    (tmp_path / "y.safetensors").write_bytes(b"not a cache")
    with pytest.raises(SafetensorError):
        load_cache(tmp_path / "y.safetensors")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_head_budget_files_saved_before_still_load_and_answer_the_same(name):
    # Written by tests/caches/data/make_head_budget_files.py at a5d86e5 (KVzip's head budgets were then a layer
    # class of their own): a padded batch with int4 (codec sinks, the context's pairs within the residual, a
    # question's recent tokens) and Gemma-3 (sliding layers saved as the other layers are, the full one ranked).
    from safetensors import safe_open

    path = DATA / f"head_budgets_{name}.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        expected = json.loads(handle.metadata()["expected"])
    model = use_kvcompress_attention(tiny_model(name))
    loaded = load_cache(path)
    assert loaded.policy.resolved_decoding == "evict"  # saved before KVzip appended later tokens by default
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes() == expected["bytes_loaded"]
    ids, mask = torch.tensor(expected["ids"]), torch.tensor(expected["mask"])
    tokens = generate(model, ids, mask, loaded, max_new_tokens=6).new_tokens
    assert tokens.tolist() == expected["new_tokens"]
    # A lossless head store decodes over its pairs and tail joined per head (caches/joined_heads.py), which hold the
    # tail's room until its next absorb besides what the file's code held, and the layout's own (gaps of grouped
    # heads, their masks and order, each head's next row): the bytes after are those plus the room and the layout.
    room = 0
    for layer in loaded.layers:
        joined = getattr(layer.store, "joined", None)
        if joined is not None:
            rows = joined.rows * joined.heads
            width = (layer.head_dim + layer.value_dim) * 4
            room += rows * (joined.capacity - joined.tail) * width + joined.layout_bytes(width)
    assert measured_kv_bytes(loaded) == loaded.promised_kv_bytes() == expected["bytes_after"] + room
    assert (name == "gemma3") == (room > 0)  # the llama file's int4 store attends through its padded view
    lengths = (expected["stored_tokens_after"], expected["seq_length_after"])
    assert (loaded.stored_tokens, loaded.get_seq_length()) == lengths


def _planned_round_trip(spec, tmp_path, ratio_bytes=True):
    """A tiny Gemma-3's `spec` cache over a 30-token prompt, saved and loaded back: (cache, loaded, path), once the
    loaded cache is checked to share the pairs as the saved one and to generate the same tokens. `ratio_bytes=False`:
    a plain ratio planned by its own rule (`SlidingShare`), as caches saved before it became a byte target."""
    from hf_kvcompress.caches.compressed import CompressedCache
    from hf_kvcompress.registry import parse_spec

    model = use_kvcompress_attention(tiny_model("gemma3"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    cache = CompressedCache(*parse_spec(spec), config=model.config, ratio_bytes=ratio_bytes)
    prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
    path = tmp_path / "planned.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    assert loaded.sliding_share == cache.sliding_share
    full = torch.cat([ids, torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(9))], 1)
    ones = torch.ones_like(full)
    assert torch.equal(generate(model, full, ones, loaded, max_new_tokens=4).new_tokens,
                       generate(model, full, ones, copy.deepcopy(cache), max_new_tokens=4).new_tokens)
    return cache, loaded, path


def _saved_before(path, entry, tmp_path):
    """(the file's `entry`, the path of a copy of the file without it): a file saved before the entry existed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    value = json.loads(metadata.pop(entry))
    older = tmp_path / "older.safetensors"
    save_file(load_file(str(path)), str(older), metadata=metadata)
    return value, older


def test_a_planned_sliding_share_is_saved_and_loads_as_planned(tmp_path):
    """A plain kvzip ratio on Gemma-3's layout planned by its own rule shares the pairs (plan.py `SlidingShare`; a
    byte target now, tests/caches/test_ratio_bytes.py); the loaded cache plans the same, and a file saved before the
    share existed (no `sliding_share` entry) loads with the plain share."""
    cache, loaded, path = _planned_round_trip("kvzip:ratio=0.5", tmp_path, ratio_bytes=False)
    assert cache.sliding_share is not None
    assert [layer.policy for layer in loaded.layers] == [layer.policy for layer in cache.layers]
    _, older = _saved_before(path, "sliding_share", tmp_path)
    plain = load_cache(older)
    assert plain.sliding_share is None
    # tiny gemma3: sliding_window 6, so the ratio's plain share is ceil(0.5 x 5) = 3 tokens, the planned one 2
    assert [layer.policy.window for layer in plain.layers[:2]] == [3, 3]
    assert [layer.policy.window for layer in loaded.layers[:2]] == [2, 2]


def test_a_planned_sliding_count_loads_as_it_was_built(tmp_path):
    """A saved cache records its planned sliding layers' count (`sliding_kept`) and loads with it; a file saved
    before it was recorded loads with the r x r count it was planned with (below half the plan now keeps fewer)."""
    cache, _, path = _planned_round_trip("kvzip:ratio=0.45", tmp_path, ratio_bytes=False)
    # tiny gemma3: sliding_window 6; ceil(2 x 0.45^3 x 5) = 1 (r x r: ceil(0.45 x 0.45 x 5) = 2, the share 3)
    assert [layer.policy.window for layer in cache.layers[:2]] == [1, 1]
    kept, older = _saved_before(path, "sliding_kept", tmp_path)
    assert kept == 1
    before = load_cache(older)
    assert [layer.policy.window for layer in before.layers[:2]] == [2, 2]
    assert before.sliding_share is not None and before.sliding_share.kept == 2


def test_a_byte_target_cache_loads_with_its_planned_sliding_layers(tmp_path):
    """`kvzip:bytes=B` plans its sliding layers' newest tokens as a ratio does (plan.py `ByteTarget`), without a
    `SlidingShare`: the saved file records the count, and the loaded cache keeps the same tokens there and answers
    with the same logits as the cache it was saved from."""
    model = use_kvcompress_attention(tiny_model("gemma3"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    cache = make_cache("kvzip:bytes=0.2", model.config)
    prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
    assert cache.sliding_share is None and cache.planned_sliding is not None
    path = tmp_path / "bytes.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    assert loaded.planned_sliding == cache.planned_sliding
    assert [layer.policy for layer in loaded.layers] == [layer.policy for layer in cache.layers]
    built = copy.deepcopy(cache)
    position = 30
    for seed in (9, 10, 11):
        step = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(seed))
        where = torch.arange(position, position + 3)[None]
        with torch.inference_mode():
            ref = model(input_ids=step, cache=built, position_ids=where).logits
            out = model(input_ids=step, cache=loaded, position_ids=where).logits
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        position += 3


def test_a_store_the_codec_now_builds_differently_is_refused_at_load(tmp_path):
    # A file saved when the spec planned another layout (here: int4's key groups of 8 tokens read as groups of 16;
    # for real, lowrank's ranks per layer changed in session 26) is refused when loaded, by name, instead of failing
    # at the first decode step deep in attention.
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = use_kvcompress_attention(tiny_model("llama"))
    ids, mask = _document(length=40)
    cache = make_cache("int4:residual_length=4,group_size=8", model.config)
    prefill(model, ids, mask, cache)
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path)
    assert load_cache(path, model=model).get_seq_length() == cache.get_seq_length()
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    metadata["spec"] = "int4:residual_length=4,group_size=16"
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with pytest.raises(ValueError, match="do not fit the codec 'int4:.*group_size=16.*' builds for this layer now"):
        load_cache(path, model=model)


def test_a_byte_target_file_saved_before_the_byte_plan_loads_with_its_codec_in_every_layer(tmp_path):
    """A plain `kvzip:bytes=B` on a hybrid model now stores every layer in int4 (plan.py `byte_codecs`), and its
    file loads so; a file saved before (no `byte_plan` entry, the spec's codec in every layer) loads as it was built,
    with the same logits."""
    from hf_kvcompress.caches.compressed import CompressedCache
    from hf_kvcompress.registry import parse_spec

    model = use_kvcompress_attention(tiny_model("gemma3"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(12))
    policy, codec = parse_spec("kvzip:bytes=0.3")
    built = {}
    for byte_plan in (True, False):
        cache = CompressedCache(policy, codec, config=model.config, byte_plan=byte_plan)
        prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
        path = tmp_path / f"bytes-{byte_plan}.safetensors"
        save_cache(cache, path)
        built[byte_plan] = (cache, path)
    (new, new_path), (old, old_path) = built[True], built[False]
    assert {type(layer.codec).__name__ for layer in new.layers} == {"IntNCodec"}
    assert {type(layer.codec).__name__ for layer in old.layers} == {"IdentityCodec"}
    assert load_cache(new_path).spec == new.spec
    _, older = _saved_before(old_path, "byte_plan", tmp_path)
    loaded = load_cache(older)
    assert [layer.codec for layer in loaded.layers] == [layer.codec for layer in old.layers]
    step, where = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(13)), torch.arange(30, 33)[None]
    with torch.inference_mode():
        ref = model(input_ids=step, cache=copy.deepcopy(old), position_ids=where).logits
        out = model(input_ids=step, cache=loaded, position_ids=where).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_a_byte_plan_file_records_its_codec_and_one_saved_before_loads_with_the_old_plans(tmp_path):
    """A plain `kvzip:bytes=B` on a hybrid model stores its sliding layers (and its full-attention layers: the spec
    names those) in the byte plan's codec, which the file records (`byte_codec`). A file without that entry was saved
    when the plan's codec was `int4:residual_length=32`: built so and saved without the entry, it loads with 32 in the
    sliding layers (not the plan's 8 now), the same bytes and the same generate() answers; a new file round-trips."""
    from hf_kvcompress.caches.compressed import CompressedCache
    from hf_kvcompress.registry import parse_spec

    from .tiny_models import tiny_hybrid_gemma

    model = tiny_hybrid_gemma()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(21))
    question = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(22))
    policy, codec = parse_spec("kvzip:bytes=0.25")
    _, before = parse_spec("int4:residual_length=32")
    built = {}
    for name, kwargs in (("now", {}), ("before", {"byte_codec": before})):
        cache = CompressedCache(policy, codec, config=model.config, **kwargs)
        prefill(model, ids, None, cache, repeat_prompt_ids=[5, 6, 7])
        path = tmp_path / f"{name}.safetensors"
        save_cache(cache, path)
        built[name] = (cache, path)
    (now, now_path), (old, old_path) = built["now"], built["before"]
    assert now.spec == "kvzip:bytes=0.25,span=4+int4:residual_length=8"
    assert old.spec == "kvzip:bytes=0.25,span=4+int4:residual_length=32"  # the spec names the full-attention codec
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert {now.layers[i].codec.residual_length for i in sliding} == {8}
    assert {old.layers[i].codec.residual_length for i in sliding} == {32}
    saved, older = _saved_before(old_path, "byte_codec", tmp_path)
    assert saved == "int4:residual_length=32"
    for cache, path in ((now, now_path), (old, older)):
        loaded = load_cache(path)
        assert loaded.spec == cache.spec
        assert [layer.codec for layer in loaded.layers] == [layer.codec for layer in cache.layers]
        assert_same_state(cache, loaded)
        assert measured_kv_bytes(loaded) == measured_kv_bytes(cache)
        full = torch.cat([ids, question], dim=1)
        with torch.inference_mode():
            a = model.generate(input_ids=full, cache=copy.deepcopy(cache), max_new_tokens=6, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
            b = model.generate(input_ids=full, cache=loaded, max_new_tokens=6, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        assert torch.equal(a.sequences, b.sequences)
        # Within float32 rounding, not bit for bit: a loaded store holds its tokens without the built one's spare
        # slots, and some evicting int4 caches sum in another order then (main's `ratio=0.5+int4:residual_length=8`
        # too); the state compared above is exact.
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), rtol=1e-5, atol=1e-6)
    # Read as the plan now builds it, the old file would hold other sliding codecs than it was built with.
    assert load_cache(older).layers[sliding[0]].codec != now.layers[sliding[0]].codec
