"""CompressedCache: a transformers `Cache` whose layers all combine one policy with one codec."""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache

from ..codecs.base import Codec, resolve_for_policy
from ..codecs.identity import IdentityCodec
from ..hf.compat import text_config
from ..policies.base import Policy
from ..policies.keep_all import KeepAllPolicy
from ..policies.sink_window import SinkWindowPolicy
from .layer import CompressedLayer

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")


class CompressedCache(Cache):
    """Drop-in for `DynamicCache`: pass it to `model.generate(..., cache=...)`.

    Args:
        policy: which tokens stay (default: all).
        codec: how kept tokens are stored (default: full precision).
        config: the model's config. Needed for models that mix sliding-window and full-attention layers: their
            sliding layers keep transformers' window (the codec still applies) and the policy, whose budget is per
            full-attention layer, applies to the full-attention layers only. Without it every layer is treated as
            full attention.
    """

    def __init__(self, policy: Policy | None = None, codec: Codec | None = None, config=None):
        self.policy = policy if policy is not None else KeepAllPolicy()
        self.codec = resolve_for_policy(codec if codec is not None else IdentityCodec(), self.policy.evicts)
        self.config = config
        if config is None:
            super().__init__(layer_class_to_replicate=partial(CompressedLayer, self.policy, self.codec))
            self.num_layers = None
            return
        decoder = text_config(config)
        layer_types = getattr(decoder, "layer_types", None) or ["full_attention"] * decoder.num_hidden_layers
        layers = []
        for layer_type in layer_types:
            if layer_type in SLIDING_LAYER_TYPES:
                window = decoder.sliding_window if layer_type == "sliding_attention" else decoder.attention_chunk_size
                # transformers keeps window - 1 tokens between steps; so do we, stored with this cache's codec.
                sliding = SinkWindowPolicy(sink_tokens=0, window=max(window - 1, 1))
                layers.append(CompressedLayer(sliding, resolve_for_policy(self.codec, True), is_sliding=True))
            else:
                layers.append(CompressedLayer(self.policy, self.codec))
        super().__init__(layers=layers)
        self.num_layers = len(layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.num_layers is not None and layer_idx >= self.num_layers:
            raise ValueError(
                f"this cache was built for a model with {self.num_layers} layers, got layer index {layer_idx}: "
                "a cache object serves one model"
            )
        if layer_idx == 0 and len(self.layers) > 1:
            seen = {layer.seen for layer in self.layers if layer.is_initialized}
            if len(seen) > 1:
                raise ValueError(
                    f"the layers of this cache have seen different numbers of tokens ({sorted(seen)}): it was used "
                    "by a model with a different layer count; call cache.reset() or create a new cache"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def spec(self) -> str:
        """The registry spec string that rebuilds this cache."""
        from ..registry import cache_spec

        return cache_spec(self.policy, self.codec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, layers={len(self.layers)})"
