"""CompressedCache: a transformers `Cache` whose layers all combine one policy with one codec."""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache

from ..codecs.base import Codec, resolve_for_model, resolve_for_policy
from ..codecs.identity import IdentityCodec
from ..hf.compat import text_config
from ..hf.rope import rope_inv_freq
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
        rerotate: StreamingLLM's re-rotation: after each eviction, kept keys are re-rotated so their distance to
            the next query is their distance in the cache, which keeps streams longer than the trained context in
            range. Positions stay absolute (no re-rotation) by default. Needs `config` (RoPE parameters and
            scaling are read from it) and full-precision keys.
    """

    def __init__(self, policy: Policy | None = None, codec: Codec | None = None, config=None, rerotate: bool = False):
        self.policy = policy if policy is not None else KeepAllPolicy()
        requested_codec = resolve_for_model(codec if codec is not None else IdentityCodec(), config)
        self.codec = resolve_for_policy(requested_codec, self.policy.evicts)
        self.config = config
        self.rerotate = rerotate
        inv_freq = None
        if rerotate:
            if config is None:
                raise ValueError("rerotate=True needs config=model.config (RoPE parameters are read from it)")
            inv_freq = rope_inv_freq(config, "full_attention")
        full_layer = partial(CompressedLayer, self.policy, codec=self.codec, inv_freq=inv_freq)
        if config is None:
            super().__init__(layer_class_to_replicate=full_layer)
            self.num_layers = None
            return
        decoder = text_config(config)
        layer_types = getattr(decoder, "layer_types", None) or ["full_attention"] * decoder.num_hidden_layers
        layers = []
        for layer_idx, layer_type in enumerate(layer_types):
            if layer_type in SLIDING_LAYER_TYPES:
                window = decoder.sliding_window if layer_type == "sliding_attention" else decoder.attention_chunk_size
                # transformers keeps window - 1 tokens between steps; so do we, stored with this cache's codec.
                sliding = SinkWindowPolicy(sink_tokens=0, window=max(window - 1, 1))
                sliding_codec = resolve_for_policy(requested_codec, True).for_layer(layer_idx)
                layers.append(CompressedLayer(sliding, sliding_codec, is_sliding=True))
            else:
                layers.append(full_layer(codec=self.codec.for_layer(layer_idx)))
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

    def promised_kv_bytes(self) -> int:
        """What the method promises to hold now, computed from what each layer keeps (see `measured_kv_bytes`)."""
        return sum(layer.promised_bytes() for layer in self.layers)

    @property
    def stored_tokens(self) -> int:
        """Tokens per KV head held by the first full-attention layer."""
        for layer in self.layers:
            if not layer.is_sliding:
                return layer.stored_tokens
        return self.layers[0].stored_tokens if self.layers else 0

    @property
    def spec(self) -> str:
        """The registry spec string that rebuilds this cache."""
        from ..registry import cache_spec

        return cache_spec(self.policy, self.codec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, layers={len(self.layers)})"
