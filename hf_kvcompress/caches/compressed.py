"""CompressedCache: a transformers `Cache` whose layers all combine one policy with one codec."""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
import transformers
from transformers.cache_utils import Cache

from ..codecs.base import Codec, resolve_for_model, resolve_for_policy
from ..codecs.identity import IdentityCodec
from ..codecs.reducing import ReducingCodec
from ..hf.attention import ATTENTION_NAME, engage
from ..hf.compat import ASSISTED_CONTINUES_CACHE, ASSISTED_REFEEDS_PROMPT, text_config
from ..hf.rope import rope_inv_freq
from ..policies.base import Policy, check_count
from ..policies.block_window import BlockWindowPolicy
from ..policies.keep_all import KeepAllPolicy
from ..policies.sink_window import SinkWindowPolicy
from .head_ranking import head_budget_keep
from .layer import CompressedLayer
from .requests import attention_kwargs, makes_requests
from .token_ranking import share_token_scores

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def sliding_kept(policy: Policy, layer_type: str, window: int) -> int | None:
    """Tokens a sliding-window layer keeps under `policy` when that is fewer than transformers' `window - 1`
    (None: the whole window).

    A budget or ratio means the same in every layer: a `budget` of B keeps B tokens per KV head, a `ratio` r keeps
    r of what the layer holds uncompressed (the newest ceil(r x (window - 1)) once the prompt is longer than the
    window), so the cache's bytes follow the ratio on hybrid models too. A sliding layer keeps its newest tokens:
    it attends locally, and KVzip's reconstruction queries, a window away, cannot score it. Chunked-attention
    layers keep their chunk. A policy's `sliding=N` sets the count itself (`dynamic:sliding=127` shrinks only the
    sliding layers): on Gemma-3-270M at 2,000 tokens they kept every answer at 127 of their 511 tokens, and lost 5 of
    30 at 63 (docs/results.md)."""
    if layer_type != "sliding_attention":
        return None
    whole = max(window - 1, 1)
    if policy.sliding is not None:
        kept = policy.sliding
    elif policy.budget is not None:
        kept = policy.budget
    elif policy.ratio is not None:
        kept = math.ceil(policy.ratio * whole)
    else:
        return None
    return max(kept, 1) if kept < whole else None


def _sliding_layer_codec(codec: Codec, layer_type: str, exact_window: bool = False) -> Codec:
    """How a sliding layer stores keys. Its window evicts, but per-channel key groups (KIVI) only need to lose whole
    groups, which a block window does (policies/block_window.py): keys are grouped as without eviction (per channel
    for int4/int3/int2 and key_axis='channel'), and an explicit key_axis='token' keeps them per token. Measured on
    Gemma-3-270M (windowed attention error of the 15 sliding layers at 2000 tokens), per-channel keys cut it from
    0.040 / 0.116 / 0.290 to 0.026 / 0.057 / 0.169 at 4 / 3 / 2 bits. Chunked-attention layers, and sliding layers
    that keep fewer tokens than their window (`exact_window`, see `sliding_kept`), keep per-token keys and an exact
    window: transformers' mask would show the older tokens of a block."""
    if layer_type == "sliding_attention" and not exact_window:
        return resolve_for_policy(codec, False)
    return resolve_for_policy(_keys_per_token(codec), True)


def _sliding_layer_policy(codec: Codec, window: int, kept: int | None = None) -> Policy:
    """transformers keeps `window - 1` tokens between steps; so do we, exactly when the codec stores single tokens,
    and dropping whole blocks when it groups keys across tokens (between window - 1 and window - 1 + block - 1).
    `kept` (from `sliding_kept`) keeps that many newest tokens instead, exactly."""
    if kept is not None:
        return SinkWindowPolicy(sink_tokens=0, window=kept)
    kept = max(window - 1, 1)
    block = max(codec.token_block("key"), codec.token_block("value"))
    return BlockWindowPolicy(window=kept, block=block) if block > 1 else SinkWindowPolicy(sink_tokens=0, window=kept)


def _keys_per_token(codec: Codec) -> Codec:
    """`codec` with an explicit key_axis='channel' turned to 'token', also in a reducing codec's storage."""
    if isinstance(codec, ReducingCodec):
        return codec.with_storage(_keys_per_token(codec.storage))
    if getattr(codec, "key_axis", None) == "channel":
        return dataclasses.replace(codec, key_axis="token")
    return codec

def layer_budget_shifts(policy: Policy, layers: list) -> list[torch.Tensor]:
    """One ranking of every (layer, KV head, slot) score per row: each layer keeps its share of the row's top
    `layers x heads x uniform share` pairs, as whole tokens per head (KVzip Sec. 3.3, Ada-KV). Returns each layer's
    share minus the uniform one, [B] per layer: added to the uniform budget, it moves with a ratio and lets a
    budget above the tokens seen keep the tokens that arrive later, up to the budget. Padding never counts."""
    share = policy.held_per_row(layers[0].padding.real_seen)  # [B]: all the row's tokens when the budget is above them
    heads = layers[0].kv_heads
    scores = []
    for layer in layers:
        slot = torch.arange(layer.stored_tokens, device=layer.device)
        padding = (slot[None, :] < layer.padding.pads[:, None])[:, None, :]
        scores.append(layer.slots.accumulated.masked_fill(padding, float("-inf")).flatten(1))  # [B, H * T]
    ranked = torch.cat(scores, dim=1).sort(dim=1, descending=True).values
    real = torch.isfinite(ranked).sum(dim=1)  # [B]: the row's real pairs (a padded row has fewer than the slots)
    wanted = torch.minimum(share * heads * len(layers), real).clamp(min=1) - 1
    threshold = ranked.gather(1, wanted[:, None])  # [B, 1]: the row's lowest kept score
    return [torch.round((s >= threshold).sum(dim=1) / heads).long() - share for s in scores]


def _check_head_budgets(policy: Policy, codec: Codec, rerotate: bool) -> None:
    """Refuse, when the cache is built, what per-head budgets cannot store."""
    if codec.heads_per_store > 1:
        raise ValueError(
            f"budgets=head keeps a different number of pairs per KV head; codec {codec.spec()!r} stores one head "
            "for several: use budgets=layer with it"
        )
    if rerotate:
        raise ValueError("rerotate re-rotates a window of whole tokens; budgets=head keeps other tokens per head")


class CompressedCache(Cache):
    """Drop-in for `DynamicCache`: pass it to `model.generate(..., cache=...)`.

    Args:
        policy: which tokens stay (default: all).
        codec: how kept tokens are stored (default: full precision).
        config: the model's config. Needed for models that mix sliding-window and full-attention layers: their
            sliding layers keep transformers' window with the codec's own key grouping (per-channel keys drop whole
            groups as the window passes them, see `_sliding_layer_codec`; an explicit `key_axis='token'` keeps
            keys per token and the exact window) and the policy, whose budget is per full-attention layer, applies
            to the full-attention layers only. Without it every layer is treated as
            full attention.
        rerotate: StreamingLLM's re-rotation: after each eviction, kept keys are re-rotated so their distance to
            the next query is their distance in the cache, which keeps streams longer than the trained context in
            range. Positions stay absolute (no re-rotation) by default. Needs `config` (RoPE parameters and
            scaling are read from it) and full-precision keys.
    """

    def __init__(self, policy: Policy | None = None, codec: Codec | None = None, config=None, rerotate: bool = False):
        # The model config whose attention the cache switches to 'kvcompress_sdpa' at its first request to attention
        # (`adopt_attention_config`, `_engage_attention`); decided once in the cache's life.
        self.attention_config = config
        self.attention_settled = False
        self.policy = policy if policy is not None else KeepAllPolicy()
        raw_codec = codec if codec is not None else IdentityCodec()
        requested_codec = resolve_for_model(raw_codec, config)
        self.codec = resolve_for_policy(requested_codec, self.policy.evicts)
        self.config = config
        self.rerotate = rerotate
        if getattr(self.policy, "budgets", "uniform") == "head":
            _check_head_budgets(self.policy, self.codec, rerotate)
        inv_freq = None
        if rerotate:
            if config is None:
                raise ValueError("rerotate=True needs config=model.config (RoPE parameters are read from it)")
            inv_freq = rope_inv_freq(config, "full_attention")
        query_inv_freq = _query_rope(self.policy, config)
        if config is None:
            if self.policy.sliding is not None:
                raise ValueError("sliding= needs config=model.config: it applies to the model's sliding-window layers")
            super().__init__(layer_class_to_replicate=_LayerFactory(self.policy, self.codec, inv_freq))
            self.num_layers = None
            return
        decoder = text_config(config)
        head_dim = getattr(decoder, "head_dim", None) or decoder.hidden_size // decoder.num_attention_heads
        self.codec.check_head_dim(head_dim)  # refuse a codec that cannot store this model now, not mid-generation
        layer_types = getattr(decoder, "layer_types", None) or ["full_attention"] * decoder.num_hidden_layers
        if self.policy.sliding is not None:
            check_count("sliding", self.policy.sliding, minimum=1)
            if "sliding_attention" not in layer_types:
                raise ValueError(
                    f"sliding={self.policy.sliding!r} sets what sliding-window layers keep, and this model has none "
                    f"(layer types: {sorted(set(layer_types))}); leave sliding unset"
                )
        # Settle key_axis before binding to the model (replace() would drop what binding sets), once per layer
        # type: binding may load calibration files (lowrank).
        windows = {"sliding_attention": getattr(decoder, "sliding_window", None),
                   "chunked_attention": getattr(decoder, "attention_chunk_size", None)}
        kept = {kind: sliding_kept(self.policy, kind, windows[kind]) for kind in SLIDING_LAYER_TYPES if kind in layer_types}
        if self.policy.sliding is not None and self.policy.sliding > windows["sliding_attention"] - 1:
            raise ValueError(
                f"sliding={self.policy.sliding} is more than this model's sliding layers hold "
                f"({windows['sliding_attention'] - 1}: sliding_window - 1); give 1 to {windows['sliding_attention'] - 1}"
            )
        sliding_codecs = {
            kind: resolve_for_model(_sliding_layer_codec(raw_codec, kind, kept[kind] is not None), config)
            for kind in kept
        }
        layers = []
        for i, layer_type in enumerate(layer_types):
            if layer_type in SLIDING_LAYER_TYPES:
                window = windows[layer_type]
                layer_codec = sliding_codecs[layer_type]
                sliding = _sliding_layer_policy(layer_codec, window, kept[layer_type])
                attention_window = window if layer_type == "sliding_attention" else None
                layers.append(CompressedLayer(
                    sliding, layer_codec.for_layer(i), is_sliding=True, attention_window=attention_window
                ))
            else:
                layers.append(CompressedLayer(
                    self.policy, self.codec.for_layer(i), inv_freq=inv_freq, query_inv_freq=query_inv_freq
                ))
        super().__init__(layers=layers)
        self.num_layers = len(layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._claim_for_this_thread(layer_idx)
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
        states = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not self.attention_settled:
            self._engage_attention(attention_kwargs(args, kwargs))
        return states

    def adopt_attention_config(self, config) -> None:
        """Called by a model from `load_model` before each forward pass: a cache built without a config may still
        switch that model's attention (and only its attention: what the layers keep does not change)."""
        if self.attention_config is None:
            self.attention_config = config

    def _engage_attention(self, attn_kwargs: dict | None) -> None:
        """At the first step where a layer asks attention for something (its store, statistics, its own mask),
        switch a model running transformers' SDPA to 'kvcompress_sdpa' (hf/attention.py: `engage`): the same
        answers, plus what the layers ask for. A model running another implementation is named once, when a layer
        would have had attention read its store; a policy that needs statistics refuses at its next step."""
        if not makes_requests(attn_kwargs):
            return
        self.attention_settled = True
        running = engage(self.attention_config)
        if running in (None, ATTENTION_NAME):
            return
        reading = [layer for layer in self.layers if layer.codec.attends_encoded and not layer.store_noted]
        for layer in reading:
            layer.store_noted = True  # said here for all of them, naming the model's attention
        if reading:
            reading[0].store_note(running)

    def _claim_for_this_thread(self, layer_idx: int) -> None:
        """Refuse a second thread while one thread's forward pass is between this cache's first and last layer:
        interleaved steps would mix two sequences in one cache without any error."""
        me = threading.get_ident()
        owner = getattr(self, "_owner", None)
        if owner is not None and owner != me:
            raise RuntimeError(
                "this cache is in use by another thread's forward pass: a cache holds one conversation; give each "
                "thread its own cache (make_cache(spec, model.config))"
            )
        last = (self.num_layers or len(self.layers)) - 1
        self._owner = None if layer_idx >= last else me

    def activate_past_recording(self) -> None:
        """Called when assisted decoding starts: refuse to start it on a prefilled cache where it would re-feed the
        prompt (hf/compat.py: `assisted_decoding_continues_cache`)."""
        held = self.get_seq_length()
        if held > 0 and not ASSISTED_CONTINUES_CACHE.get():
            raise ValueError(ASSISTED_REFEEDS_PROMPT.format(version=transformers.__version__, held=held))
        super().activate_past_recording()

    def reset(self) -> None:
        self._owner = None
        super().reset()

    # -- the reconstruction pass (KVzip), driven by generation.prefill: the cache cannot call the model itself --

    def begin_reconstruction(self) -> None:
        """From now on, layers attend over what they keep plus the new tokens, keep nothing new, and (when the
        policy scores by reconstruction) record the most attention each kept slot receives."""
        for layer in self.layers:
            layer.begin_reconstruction()

    def reconstruction_queries(self, query_mask: torch.Tensor) -> None:
        """The queries of the next reconstruction step that count, [B, q] bool (padding inside a chunk does not)."""
        for layer in self.layers:
            layer.reconstruction_queries = query_mask.bool()

    def end_reconstruction(self, evict: bool = True) -> None:
        """Evict the lowest-scored slots down to the budget; later tokens are stored again. `evict=False` (the pass
        failed) keeps every slot unscored, so decoding past the budget refuses as if the pass never ran."""
        if not evict:
            for layer in self.layers:
                layer.end_reconstruction(evict=False)
            return
        scored = [layer for layer in self.layers if layer.policy.scores_by_reconstruction and layer.is_initialized]
        budgets = getattr(self.policy, "budgets", "uniform")
        if budgets == "head" and scored:
            keeps = head_budget_keep(self.policy, scored, 0 if self.codec.lossless else self.codec.sink_tokens)
            for layer, (priority, keep) in zip(scored, keeps):
                layer.rank_heads(priority, keep)
        elif budgets == "token" and scored:
            share_token_scores([layer for layer in scored if not layer.is_sliding])
        elif budgets == "layer" and len(scored) > 1:
            for layer, shift in zip(scored, layer_budget_shifts(self.policy, scored)):
                layer.budget_shift = shift
        for layer in self.layers:
            if not layer.per_head:
                layer.end_reconstruction()

    def promised_kv_bytes(self, dtype: torch.dtype | None = None) -> int:
        """What the method promises to hold now, computed from what each layer keeps (see `measured_kv_bytes`);
        with `dtype`, what it would hold had the model run in that dtype (`measure.served_kv_bytes`)."""
        return sum(layer.promised_bytes(dtype) for layer in self.layers)

    @property
    def stored_tokens(self) -> int:
        """Tokens per KV head held by the first full-attention layer (with KVzip's head budgets, whose layers keep
        different shares: the mean over the full-attention layers)."""
        ranked = [layer.stored_tokens for layer in self.layers if layer.per_head]
        if ranked:
            return round(sum(ranked) / len(ranked))
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


def _query_rope(policy: Policy, config) -> torch.Tensor | None:
    """The full-attention layers' RoPE frequencies, for a policy that keeps queries before RoPE (empty: the model
    does not rotate them); None for the other policies."""
    if not policy.needs_queries:
        return None
    if config is None:
        raise ValueError(
            f"{policy.name} needs config=model.config (make_cache(spec, model.config)): it reads the RoPE "
            "frequencies to undo the rotation of the queries it models"
        )
    if getattr(text_config(config), "rope_parameters", None) is None:
        return torch.zeros(0)
    return rope_inv_freq(config, "full_attention")


class _LayerFactory:
    """Builds the layers of a cache made without a config, numbering them so per-layer codecs (rotation seeds)
    match those of a cache built from the config."""

    def __init__(self, policy: Policy, codec: Codec, inv_freq: torch.Tensor | None):
        self.policy, self.codec, self.inv_freq = policy, codec, inv_freq
        self.built = 0

    def __call__(self) -> CompressedLayer:
        layer = CompressedLayer(self.policy, self.codec.for_layer(self.built), inv_freq=self.inv_freq)
        self.built += 1
        return layer
