"""generation.py: prefill and generate on a tiny model, and what a prefilled cache can be handed to afterwards."""

import copy

import pytest
import torch

from hf_kvcompress import load_cache, make_cache, prefill, save_cache, use_kvcompress_attention

from .caches.tiny_models import tiny_model

REPEAT = [5, 6, 7]  # a stand-in reconstruction prompt for KVzip on a model without a tokenizer


def _greedy(model, ids, cache, n=6, **kwargs):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=n,
                          do_sample=False, temperature=None, top_p=None, top_k=None, **kwargs)[:, ids.shape[1]:]


@pytest.mark.parametrize("spec", [
    "int4:residual_length=4,group_size=4", "snapkv:ratio=0.5,window=8,recent=8", "kvzip:ratio=0.5,budgets=uniform",
    "kvzip:ratio=0.5,budgets=token", "kvzip:ratio=0.5,budgets=layer", "kvzip:ratio=0.5",
])
def test_a_prefilled_cache_serves_transformers_generate(spec, tmp_path):
    # prefill ran under torch.inference_mode, so generate() (under no_grad) raised "Inplace update to inference
    # tensor outside InferenceMode" at the first in-place update of the cache's bookkeeping.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = make_cache(spec, model.config)
    prefill(model, ids[:, :-1], None, cache, repeat_prompt_ids=REPEAT)
    copied = copy.deepcopy(cache)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors")
    first = _greedy(model, ids, cache)
    assert first.shape == (1, 6)
    assert torch.equal(_greedy(model, ids, copied), first)
    assert torch.equal(_greedy(model, ids, loaded), first)


def _lookup_prompt(n=24):
    # A repetitive prompt, so prompt lookup finds long matches (and the assistant, the model itself, agrees).
    motif = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(2))
    return motif.repeat(n // 6)[None]


MODES = ["assisted", "prompt_lookup"]


def _speculative(mode, model):
    return {"prompt_lookup_num_tokens": 10} if mode == "prompt_lookup" else {"assistant_model": model}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", ["dynamic", "int8", "fp8", "kvzip:ratio=1.0,budgets=uniform"])
def test_speculative_decoding_through_generate_answers_its_greedy_tokens(spec, mode):
    # generate() prefills all but the last prompt token, then hands transformers the whole prompt; its assisted
    # decoding fed that prompt again on top of the cache (the answer was computed over a duplicated prompt).
    from hf_kvcompress.generation import generate

    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _lookup_prompt()
    greedy = generate(model, ids, None, make_cache(spec, model.config), max_new_tokens=20, repeat_prompt_ids=REPEAT)
    fast = generate(model, ids, None, make_cache(spec, model.config), max_new_tokens=20, repeat_prompt_ids=REPEAT,
                    **_speculative(mode, model))
    assert torch.equal(fast.new_tokens, greedy.new_tokens)
    if spec == "dynamic":
        assert torch.equal(greedy.new_tokens, _greedy(model, ids, make_cache("dynamic", model.config), n=20))


@pytest.mark.parametrize("mode", MODES)
def test_transformers_assisted_decoding_refuses_a_prefilled_cache(mode):
    # transformers 5.24 would feed the prompt again on top of the cache; the message names the way that works.
    model = use_kvcompress_attention(tiny_model("llama"))
    ids = _lookup_prompt()
    cache = make_cache("int8", model.config)
    prefill(model, ids[:, :-1], None, cache)
    with pytest.raises(ValueError, match=r"hf_kvcompress\.generation\.generate\(model, input_ids"):
        _greedy(model, ids, cache, **_speculative(mode, model))


def _fed_to_the_pass(model, ids, mask, prompt):
    """The token ids the reconstruction pass feeds the model, per chunk, with the scored cache."""
    from hf_kvcompress.generation import generate
    from hf_kvcompress.hf.compat import cache_argument_name

    fed, forward = [], model.forward

    def recording(*args, **kwargs):
        cache = kwargs.get(cache_argument_name())
        if cache is not None and getattr(cache.layers[0], "reconstruction_queries", None) is not None:
            fed.append(kwargs["input_ids"].clone())
        return forward(*args, **kwargs)

    model.forward = recording
    try:
        new = generate(model, ids, mask, make_cache("kvzip:ratio=0.5", model.config), max_new_tokens=4,
                       repeat_prompt_ids=prompt).new_tokens
    finally:
        del model.forward
    return fed, new


def test_the_pass_repeats_the_text_after_the_chat_template_prefix_and_padded_rows_equal_rows_alone():
    from hf_kvcompress.generation import RepeatPrompt

    model = use_kvcompress_attention(tiny_model("llama"))
    prefix = [9, 10, 11, 12]
    prompt = RepeatPrompt(REPEAT, context_prefix=prefix)
    assert list(prompt) == REPEAT and prompt.context_prefix == tuple(prefix)
    text = torch.randint(13, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([torch.tensor([prefix]), text], dim=1)
    fed, _ = _fed_to_the_pass(model, ids, None, prompt)
    # generate leaves the last prompt token to decoding: the pass repeats the rest of the text, not the prefix
    assert [f.tolist() for f in fed] == [[REPEAT + text[0, :-1].tolist()]]
    fed, _ = _fed_to_the_pass(model, ids, None, REPEAT)  # a plain list: the whole row, as before
    assert [f.tolist() for f in fed] == [[REPEAT + ids[0, :-1].tolist()]]
    # A row without the prefix repeats all of itself; in a padded batch each row is repeated as it is alone.
    rows = [ids[0], torch.randint(13, 128, (17,), generator=torch.Generator().manual_seed(4))]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - len(row):], mask[i, width - len(row):] = row, 1
    _, batched = _fed_to_the_pass(model, batch, mask, prompt)
    for i, row in enumerate(rows):
        _, alone = _fed_to_the_pass(model, row[None], None, prompt)
        assert torch.equal(batched[i], alone[0]), f"row {i}"
