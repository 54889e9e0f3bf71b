"""Version shims: the one place that knows how transformers' API moved between 5.x releases."""

from __future__ import annotations

import inspect
from functools import lru_cache

import transformers


@lru_cache(maxsize=None)
def cache_argument_name() -> str:
    """Name of generate()'s cache argument: `cache` since transformers 5.24, `past_key_values` before."""
    params = inspect.signature(transformers.GenerationMixin.generate).parameters
    if "cache" in params:
        return "cache"
    # 5.24 takes `cache` through a deprecation decorator that renames `past_key_values`; older 5.x only knows the latter.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for generate() or a forward call, whichever name this transformers takes."""
    return {cache_argument_name(): cache}


def text_config(config):
    """The decoder's config of a (possibly multimodal) model config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
