"""Left padding: each cache layer must know which slots are padding, however the batch was fed.

transformers 5.24's generate() gives padding position 0 (the same as a row's first real token), our prefill gives
it 1, and a plain forward without position_ids gives no per-row information at all. Eviction needs to know: padding
must never become a row's attention sinks.
"""

import pytest
import torch

from hf_kvcompress import make_cache, measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.policies.sink_window import SinkWindowPolicy

from .tiny_models import tiny_model

EVICTING = ["sink_window:sink_tokens=2,window=6", "h2o:budget=8,recent=3", "h2o:budget=8,recent=2,sink_tokens=1+int8"]


def _padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return rows, ids, mask


def _hf_generate(model, ids, mask, spec, **kwargs):
    cache = make_cache(spec, model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return use_kvcompress_attention(tiny_model(request.param))


@pytest.mark.parametrize("spec", EVICTING)
@pytest.mark.parametrize("chunk", [None, 5])
def test_generate_with_more_padding_than_the_budget_matches_rows_alone(model, spec, chunk):
    # 30 padding slots on the short row: more than the budget (8) and more than a prefill chunk (5).
    rows, ids, mask = _padded((12, 42))
    batched = _hf_generate(model, ids, mask, spec, prefill_chunk_size=chunk)
    for i, row in enumerate(rows):
        ones = torch.ones(1, len(row), dtype=torch.long)
        alone = _hf_generate(model, row[None], ones, spec, prefill_chunk_size=chunk)
        assert torch.equal(batched[i], alone[0]), f"row {i} with {spec}, chunk {chunk}"


def _layer(batch=2):
    layer = CompressedLayer(SinkWindowPolicy(sink_tokens=1, window=100), IdentityCodec())
    return layer, torch.zeros(batch, 1, 1, 8)


def _feed(layer, positions):
    positions = torch.tensor(positions)
    states = torch.zeros(positions.shape[0], 1, positions.shape[1], 8)
    layer.update(states, states, kwargs={"position_ids": positions})


@pytest.mark.parametrize("pad_position", [0, 1])
def test_padding_counted_from_either_position_convention(pad_position):
    layer, _ = _layer()
    p = pad_position
    _feed(layer, [[p, p, p, 0, 1], [0, 1, 2, 3, 4]])
    assert layer.pads.tolist() == [3, 0] and layer.real_seen.tolist() == [2, 5]
    _feed(layer, [[2], [5]])
    assert layer.pads.tolist() == [3, 0] and layer.real_seen.tolist() == [3, 6]


@pytest.mark.parametrize("pad_position", [0, 1])
def test_a_chunk_of_only_padding_is_padding(pad_position):
    # generate()'s padding at position 0 makes an all-padding chunk look like padding + one first token, until the
    # next chunk starts again at position 0.
    layer, _ = _layer()
    p = pad_position
    _feed(layer, [[p, p, p], [0, 1, 2]])
    _feed(layer, [[p, 0, 1], [3, 4, 5]])
    assert layer.pads.tolist() == [4, 0] and layer.real_seen.tolist() == [2, 6]


def test_a_single_row_with_offset_positions_is_all_real():
    layer, _ = _layer(batch=1)
    _feed(layer, [[5, 6, 7, 8]])
    assert layer.pads.tolist() == [0] and layer.real_seen.tolist() == [4]


@pytest.mark.parametrize("spec", EVICTING)
def test_padded_forward_without_position_ids_is_refused_before_padding_becomes_sinks(spec):
    model = tiny_model("llama") if "h2o" not in spec else use_kvcompress_attention(tiny_model("llama"))
    _, ids, mask = _padded((5, 20), seed=3)
    cache = make_cache(spec, model.config)
    with torch.no_grad(), pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, attention_mask=mask, cache=cache)


def test_forward_without_position_ids_is_fine_while_nothing_is_evicted():
    model = tiny_model("llama")
    _, ids, mask = _padded((5, 9), seed=4)
    cache = make_cache("sink_window:sink_tokens=2,window=100", model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    assert cache.get_seq_length() == 9


def test_per_channel_key_groups_across_padding_are_flagged():
    # KIVI's key groups run over token slots shared by the batch: 3 padding slots shift a row's groups by 3.
    model = tiny_model("llama")
    _, ids, mask = _padded((13, 16), seed=5)
    with pytest.warns(UserWarning, match="key_axis='token'"):
        model.generate(input_ids=ids, attention_mask=mask, cache=make_cache("int4:residual_length=0,group_size=8",
                       model.config), max_new_tokens=2, do_sample=False)
    _, ids, mask = _padded((8, 16), seed=5)  # 8 padding slots: a whole group, rows keep their own groups
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(input_ids=ids, attention_mask=mask, cache=make_cache("int4:residual_length=0,group_size=8",
                       model.config), max_new_tokens=2, do_sample=False)


def _prefilled_logits(model, ids, mask, spec, new_tokens):
    """Greedy logits [B, new, V] of model.generate after KVzip's pass prefilled the cache with all but the last
    token."""
    from hf_kvcompress.generation import prefill

    cache = make_cache(spec, model.config)
    with torch.inference_mode():  # prefill runs in inference mode: so must the steps that update its tensors
        prefill(model, ids[:, :-1], mask[:, :-1], cache, repeat_prompt_ids=[5, 6, 7])
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1), cache


@pytest.mark.parametrize("budgets", ["uniform", "layer", "token"])
def test_a_padded_row_keeps_as_many_tokens_at_full_precision_as_alone(budgets):
    # After KVzip's ranking each row keeps its newest kept tokens at full precision, the fewest over its heads. The
    # tail is shared by the batch: it took the fewest over all rows, so other rows decided how many of a row's
    # residual tokens were quantized (|dlogit| up to 0.3). 40 new tokens cross the residual of 32 (encoding).
    model = use_kvcompress_attention(tiny_model("llama"))
    spec = f"kvzip:ratio=0.5,budgets={budgets}+int4:residual_length=32,group_size=16"
    rows, ids, mask = _padded((120, 60, 90), seed=6)
    batched, cache = _prefilled_logits(model, ids, mask, spec, 40)
    assert measured_kv_bytes(cache) == cache.promised_kv_bytes()
    for i, row in enumerate(rows):
        alone, _ = _prefilled_logits(model, row[None], torch.ones(1, len(row), dtype=torch.long), spec, 40)
        torch.testing.assert_close(batched[i], alone[0], rtol=1e-4, atol=1e-4, msg=f"row {i}")
