"""Version shims: the one place that knows how transformers' API moved between 5.x releases."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import transformers


@cache
def cache_argument_name() -> str:
    """Name of generate()'s cache argument: `cache` since transformers 5.24, `past_key_values` before."""
    params = inspect.signature(transformers.GenerationMixin.generate).parameters
    if "cache" in params:
        return "cache"
    # 5.24 takes `cache` through a deprecation decorator that renames `past_key_values`; older 5.x only knows the
    # latter.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for generate() or a forward call, whichever name this transformers takes."""
    return {cache_argument_name(): cache}


def text_config(config):
    """The decoder's config of a (possibly multimodal) model config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


# True while `assisted_decoding_continues_cache` is active: CompressedCache then lets assisted decoding start on a
# cache that already holds tokens (see there).
ASSISTED_CONTINUES_CACHE: ContextVar[bool] = ContextVar("ASSISTED_CONTINUES_CACHE", default=False)

ASSISTED_REFEEDS_PROMPT = (
    "assisted decoding (prompt_lookup_num_tokens=, assistant_model=) in transformers {version} feeds its first step "
    "the whole prompt again, on top of the {held} tokens this cache already holds, so it would answer over a "
    "duplicated prompt: call hf_kvcompress.generation.generate(model, input_ids, attention_mask, cache, ...), which "
    "feeds only the tokens the cache lacks, or hand generate() an empty cache"
)


@contextmanager
def assisted_decoding_continues_cache(model):
    """Within this block, `model.generate` with assisted decoding continues a cache that already holds a prefix.

    transformers 5.24's `_assisted_decoding` builds its first step's inputs with `next_sequence_length=None`, so the
    whole prompt (plus the draft) reaches a prefilled cache again, where `_prefill` slices off what the cache holds.
    Here the first step is sliced the same way: when the attention mask (or, without one, the position ids) spans
    the inputs (the full sequence was passed) and the cache holds part of it, only the rest is fed. Other calls
    pass through unchanged (they come with a `next_sequence_length`, or with only the new tokens), as do versions
    that slice by themselves.
    """
    if "prepare_inputs_for_generation" in vars(model):  # nested: the outer block already slices
        yield
        return
    original = model.prepare_inputs_for_generation

    def prepare(input_ids, next_sequence_length=None, cache=None, attention_mask=None, is_first_iteration=False,
                **kwargs):
        # generate() drops an all-ones attention mask; the position ids then span the sequence passed.
        span = attention_mask if attention_mask is not None else kwargs.get("position_ids")
        if (
            is_first_iteration and next_sequence_length is None and cache is not None
            and kwargs.get("inputs_embeds") is None and (span is None or span.shape[-1] == input_ids.shape[-1])
        ):
            held = cache.get_seq_length()
            if 0 < held < input_ids.shape[-1]:
                next_sequence_length = input_ids.shape[-1] - held
        return original(input_ids, next_sequence_length=next_sequence_length, cache=cache,
                        attention_mask=attention_mask, is_first_iteration=is_first_iteration, **kwargs)

    model.prepare_inputs_for_generation = prepare
    marker = ASSISTED_CONTINUES_CACHE.set(True)
    try:
        yield
    finally:
        ASSISTED_CONTINUES_CACHE.reset(marker)
        del model.prepare_inputs_for_generation
