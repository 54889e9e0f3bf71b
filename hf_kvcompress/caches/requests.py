"""What a cache layer hands the attention function through transformers' attention kwargs.

transformers passes the same kwargs dict to a cache layer's `update` and then to attention, so a layer asks for
attention statistics, hands over its own mask or offers its encoded store by putting an object under one of these
keys; our attention function (hf/attention.py) reads them and any other one ignores them. Kept apart from the layer
so that the attention function imports the protocol, not the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

# The key under which a layer asks the attention function for statistics (see hf/attention.py).
OBSERVER_KEY = "kvcompress_observer"
# The key under which a layer whose length differs from the other layers' hands attention its own mask.
MASK_KEY = "kvcompress_mask"
# The key under which a layer offers attention its encoded store, to read a block at a time.
STORE_KEY = "kvcompress_store"
# The other way round: the key under which the hook on each attention module (hf/hidden_states.py) hands the
# layer the hidden state entering attention, [B, new, hidden], for a policy that scores from it (KVzap's probe).
HIDDEN_KEY = "kvcompress_hidden"

ENABLE_ATTENTION_HINT = (
    "load the model with `hf_kvcompress.load_model` or build the cache with config=model.config (a model running "
    "'sdpa' is then switched to 'kvcompress_sdpa' by the cache), or call "
    "`hf_kvcompress.use_kvcompress_attention(model)` once before generating (it registers the 'kvcompress_sdpa' "
    "attention function with transformers and switches the model to it)"
)
# Why a layer whose store attention never reached says so once (see store_offer.py).
STORE_NOT_REACHED = (
    "this cache's {codec} store is read by decode attention through 'kvcompress_sdpa', which this model does not "
    "run{named}: every decode step decodes the whole store instead (the answers are the same, decoding is slower). "
    "To read it directly: {hint}"
)
HIDDEN_STATES_HINT = (
    "call `hf_kvcompress.use_kvcompress_attention(model)` once before generating (it also hooks each attention "
    "module so that the cache receives the hidden state entering it)"
)


@dataclass
class AttentionRequest:
    """What a layer asks the attention function for: statistics over some queries, reduced per key, or (with
    `queries`) those queries themselves."""

    deliver: Callable[[torch.Tensor], None]  # receives [B, H_kv, kv], or [B, H_q, n, D] with `queries`
    newest_queries: int | None = None  # None: every query of the step
    reduction: str = "sum"  # "sum" or "max" over queries and over the query heads of a KV group
    query_mask: torch.Tensor | None = None  # [B, q] bool: queries that count (reconstruction padding does not)
    queries: bool = False  # deliver the newest queries as attention uses them (RoPE applied, scaled), float32


class AttendsStore(Protocol):
    """What offers its store (a CompressedLayer): attention over what it holds, then its step's eviction."""

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor: ...


@dataclass
class StoreRequest:
    """A layer offers attention its encoded store (see caches/store_attention.py): `fused` once our attention
    function has taken an offer before (what update returned is then a placeholder); `used` is set by it."""

    layer: AttendsStore
    fused: bool
    used: bool = False
    reached: bool = False  # set by our attention function whenever it receives the request, taken or not


@dataclass
class OwnMask:
    """A layer's own attention mask, for when transformers' shared mask does not fit what the layer keeps."""

    mask: torch.Tensor  # [B, 1, q, kv] bool
    used: bool = False  # set by the attention function (hf/attention.py): any other one ignores the mask


def makes_requests(attn_kwargs: dict | None) -> bool:
    """Whether a layer put a request for our attention function into these attention kwargs."""
    return attn_kwargs is not None and any(key in attn_kwargs for key in (OBSERVER_KEY, MASK_KEY, STORE_KEY))


def attention_kwargs(args, kwargs) -> dict | None:
    """The dict of attention kwargs transformers hands to `update` (it is later unpacked into attention)."""
    if isinstance(kwargs.get("kwargs"), dict):
        return kwargs["kwargs"]
    if args and isinstance(args[0], dict):
        return args[0]
    return None
