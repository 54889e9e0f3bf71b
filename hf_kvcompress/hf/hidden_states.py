"""Hand a cache layer the hidden state entering its attention module, for policies that score tokens from it.

transformers calls `cache.update(keys, values, layer_idx, kwargs=kwargs)` from inside attention, with the attention
kwargs but not the hidden state. A forward pre-hook on each attention module puts the hidden state it receives (the
decoder layer's normalized input: KVzap's probe input, arXiv:2601.07891) into those kwargs under `HIDDEN_KEY`, so
it reaches the layer's `update` in the same forward call, through plain `model.generate(cache=...)` too. The hook
adds it only for a cache that asks (`reads_hidden_states`), so every other cache and attention function sees the
kwargs they always saw; attention functions ignore keys they do not know.
"""

from __future__ import annotations

import weakref

import torch

from ..caches.requests import HIDDEN_KEY

# The attention modules already hooked: hooking is idempotent (use_kvcompress_attention may be called again).
_HOOKED: weakref.WeakSet = weakref.WeakSet()


def _offer_hidden_state(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not getattr(cache, "reads_hidden_states", False):
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is None:
        return None
    kwargs[HIDDEN_KEY] = hidden
    return args, kwargs


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules: those that call the cache (they carry their decoder layer's `layer_idx`)."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


def offer_hidden_states(model):
    """Hook every attention module of `model` (once) so that caches that read hidden states receive them."""
    for module in attention_modules(model):
        if module not in _HOOKED:
            module.register_forward_pre_hook(_offer_hidden_state, with_kwargs=True)
            _HOOKED.add(module)
    return model
