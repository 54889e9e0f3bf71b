"""CompressedCache: a transformers `Cache` whose layers all combine one policy with one codec."""

from __future__ import annotations

import threading
import warnings

import torch
import transformers
from transformers.cache_utils import Cache

from ..codecs.base import Codec
from ..codecs.identity import IdentityCodec
from ..hf.attention import ATTENTION_NAME, engage
from ..hf.compat import ASSISTED_CONTINUES_CACHE, ASSISTED_REFEEDS_PROMPT
from ..policies.base import Policy
from ..policies.keep_all import KeepAllPolicy
from .head_ranking import head_budget_keep
from .head_store import HeadStore, RankedTogether, head_store_counts
from .layer import CompressedLayer
from .plan import (
    ByteTarget,
    LayerPlan,
    SlidingShare,
    byte_codecs,
    byte_plan_codec,
    cache_codec,
    check_without_config,
    config_layer_types,
    for_model,
    plan_layers,
    ratio_as_bytes,
    unplanned_layer,
)
from .requests import attention_kwargs, makes_requests
from .token_ranking import share_token_scores


def cache_spec(policy: Policy, codec: Codec) -> str:
    """The spec string (registry.py's `parse_spec` reads it) that rebuilds `policy` x `codec`: `int4`, not
    `dynamic+int4`; `sink_window:window=256`, not `sink_window:window=256+identity`."""
    base = policy.spec()
    if isinstance(codec, IdentityCodec):
        return base
    if isinstance(policy, KeepAllPolicy) and base == KeepAllPolicy.name:
        return codec.spec()
    return f"{base}+{codec.spec()}"


def layer_from_plan(plan: LayerPlan) -> CompressedLayer:
    """The layer a plan describes (plan.py: `plan_layers`)."""
    return CompressedLayer(plan.policy, plan.codec, is_sliding=plan.is_sliding, inv_freq=plan.inv_freq,
                           query_inv_freq=plan.query_inv_freq, attention_window=plan.attention_window,
                           probe=plan.probe)


def layer_budget_shifts(policy: Policy, layers: list, extra: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One ranking of every (layer, KV head, slot) score per row: each layer keeps its share of the row's top
    `layers x heads x (uniform share + extra)` pairs, as whole tokens per head (KVzip Sec. 3.3, Ada-KV). Returns each
    layer's share minus the uniform one, [B] per layer: added to the uniform budget, it moves with a ratio and lets
    a budget above the tokens seen keep the tokens that arrive later, up to the budget. Padding never counts.
    `extra` [B]: tokens per head the sliding layers gave up to these layers (plan.py `SlidingShare`)."""
    uniform = policy.held_per_row(layers[0].padding.real_seen)  # [B]: all the row's tokens when the budget is above
    share = uniform if extra is None else uniform + extra
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
    return [torch.round((s >= threshold).sum(dim=1) / heads).long() - uniform for s in scores]


def _check_head_budgets(policy: Policy, codec: Codec, rerotate: bool) -> None:
    """Refuse, when the cache is built, what per-head budgets cannot store."""
    if codec.heads_per_store > 1:
        raise ValueError(
            f"budgets=head keeps a different number of pairs per KV head; codec {codec.spec()!r} stores one head "
            "for several: use budgets=layer with it"
        )
    if rerotate:
        raise ValueError("rerotate re-rotates a window of whole tokens; budgets=head keeps other tokens per head")
    if codec.needs_positions:
        raise ValueError(
            f"budgets=head keeps no per-slot positions, and codec {codec.spec()!r} decodes keys at theirs: use "
            "budgets=layer with it"
        )


class CompressedCache(Cache):
    """Drop-in for `DynamicCache`: pass it to `model.generate(..., cache=...)`.

    Args:
        policy: which tokens stay (default: all).
        codec: how kept tokens are stored (default: full precision).
        config: the model's config. Needed for models that mix sliding-window and full-attention layers: their
            sliding layers keep transformers' window with the codec's own key grouping (per-channel keys drop whole
            groups as the window passes them, see `sliding_layer_codec` in plan.py, which plans every layer; an
            explicit `key_axis='token'` keeps keys per token and the exact window) and the policy, whose budget is
            per full-attention layer, applies to the full-attention layers only. Without it every layer is treated
            as full attention.
        rerotate: StreamingLLM's re-rotation: after each eviction, kept keys are re-rotated so their distance to
            the next query is their distance in the cache, which keeps streams longer than the trained context in
            range. Positions stay absolute (no re-rotation) by default. Needs `config` (RoPE parameters and
            scaling are read from it) and full-precision keys.
        share_sliding: a plain KVzip ratio shares a hybrid model's pairs between its sliding and full-attention
            layers (plan.py `SlidingShare`); False gives every layer the ratio's share, as caches saved before the
            share existed were built (persist.py).
        planned_sliding: the tokens a planned sliding layer keeps instead of the plan's (a saved cache's own count,
            persist.py); None: the plan's.
        byte_plan: KVzip's bytes= with no codec given stores the full-attention layers in the plan's int4, and on
            a hybrid model the sliding layers whatever the codec (plan.py `byte_codecs`); False keeps the codec given
            in every layer, as caches saved before that plan were built (persist.py).
        byte_codec: the byte plan's codec (plan.py `byte_codecs`; None: `byte_plan_codec`'s for the layout): a
            saved cache's own, for files saved while the plan used another (persist.py).
        ratio_bytes: a plain KVzip ratio below a half is planned as its byte target (plan.py `ratio_as_bytes`);
            False keeps the ratio's own plan, as caches saved before were built (persist.py).
    """

    # Every layer is one: built from a plan, or by `_LayerFactory` without a config (list is invariant, so the
    # narrower element type is an override mypy refuses although no other layer is ever stored).
    layers: list[CompressedLayer]  # type: ignore[assignment]
    # Only on a cache that `load_cache` (persist.py) returned: the model it was saved from.
    model_name: str
    architecture: dict

    def __init__(self, policy: Policy | None = None, codec: Codec | None = None, config=None, rerotate: bool = False,
                 share_sliding: bool = True, planned_sliding: int | None = None, byte_plan: bool = True,
                 ratio_bytes: bool = True, byte_codec: Codec | None = None):
        # The model config whose attention the cache switches to 'kvcompress_sdpa' at its first request to attention
        # (`adopt_attention_config`, `_engage_attention`); decided once in the cache's life.
        self.attention_config = config
        self.attention_settled = False
        requested = codec if codec is not None else IdentityCodec()
        policy = policy if policy is not None else KeepAllPolicy()
        if ratio_bytes:  # a plain KVzip ratio below a half: its byte target (the spec then names it)
            policy, requested = ratio_as_bytes(policy, requested, config)
        # Layout-dependent defaults (KVzip's span) settled once here, so every layer and the spec hold what is used.
        self.policy = for_model(policy, config)
        if config is not None and byte_plan:  # KVzip's plain bytes=: the full-attention layers in the plan's codec
            requested = byte_codecs(self.policy, requested, config_layer_types(config), byte_codec)[0]
        self.codec = cache_codec(self.policy, requested, config)
        self.config = config
        self.rerotate = rerotate
        if getattr(self.policy, "budgets", "uniform") == "head":
            _check_head_budgets(self.policy, self.codec, rerotate)
        # What a hybrid model's sliding layers give up to the full-attention ones (plan.py), applied when the pass
        # ranks them; None without a config or a planned share.
        self.sliding_share: SlidingShare | None = None
        self.byte_target: ByteTarget | None = None  # KVzip's bytes=: what the ranking may spend (plan.py)
        self.planned_sliding: int | None = None
        # The byte plan's codec as this cache applied it (KVzip's bytes= with `byte_plan`; save_cache records it);
        # None: no byte plan.
        self.byte_codec: Codec | None = None
        if config is None:
            check_without_config(self.policy, rerotate)
            # transformers only calls `layer_class_to_replicate()`: a factory that numbers the layers serves.
            super().__init__(layer_class_to_replicate=_LayerFactory(self.policy, self.codec))  # type: ignore[arg-type]
            self.num_layers = None
            return
        plans = plan_layers(self.policy, requested, config, rerotate, full_codec=self.codec,
                            share_sliding=share_sliding, planned_sliding=planned_sliding, byte_plan=byte_plan,
                            ratio_bytes=False, byte_codec=byte_codec)  # settled above
        super().__init__(layers=[layer_from_plan(plan) for plan in plans])
        self.num_layers = len(plans)
        self.sliding_share = next((plan.sliding_share for plan in plans if plan.sliding_share is not None), None)
        self.byte_target = next((plan.byte_target for plan in plans if plan.byte_target is not None), None)
        # The newest tokens the planned sliding layers keep (a plain ratio's, bytes='s or KVzap's budget's plan); None:
        # not planned.
        self.planned_sliding = next((p.planned_kept for p in plans if p.planned_kept is not None), None)
        if byte_plan and self.byte_target is not None:
            self.byte_codec = byte_codec if byte_codec is not None else byte_plan_codec(config_layer_types(config))

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
        if layer_idx == 0 and key_states.shape[-2] == 1 and self.policy.ranks_prompt:
            self.rank_prompt()  # model.generate's first decode step: the prompt is read (no-op once ranked)
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
        reading = [layer for layer in self.layers if layer.codec.attends_encoded and not layer.offers.noted]
        for layer in reading:
            layer.offers.noted = True  # said here for all of them, naming the model's attention
        if reading:
            reading[0].offers.note(running)

    @property
    def reads_hidden_states(self) -> bool:
        """Whether the layers score tokens from the hidden state entering attention (KVzap): the hooks of
        hf/hidden_states.py then hand it over in the attention kwargs."""
        return self.policy.needs_hidden_states

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

    def activate_past_recording(self, **kwargs) -> None:
        """Called when assisted decoding starts: refuse to start it on a prefilled cache where it would re-feed the
        prompt (hf/compat.py: `assisted_decoding_continues_cache`). `kwargs`: what transformers passes on to the
        layers (5.25 added `recurrent_states_to_keep`, for linear-attention layers; 5.24 passes none)."""
        held = self.get_seq_length()
        if held > 0 and not ASSISTED_CONTINUES_CACHE.get():
            raise ValueError(ASSISTED_REFEEDS_PROMPT.format(version=transformers.__version__, held=held))
        super().activate_past_recording(**kwargs)

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
        extra = self._sliding_extra(scored)
        if budgets == "head" and scored:
            self._rank_heads(scored, extra)
        elif budgets == "layer" and len(scored) > 1:
            for layer, shift in zip(scored, layer_budget_shifts(self.policy, scored, extra), strict=True):
                layer.eviction.budget_shift = shift
        else:
            if budgets == "token" and scored:
                share_token_scores([layer for layer in scored if not layer.is_sliding])
            if extra is not None:  # every full-attention layer keeps the same extra tokens per head
                for layer in scored:
                    layer.eviction.budget_shift = extra.clone()
        for layer in self.layers:
            if not layer.per_head:
                layer.end_reconstruction()

    def rank_prompt(self) -> None:
        """KVzap's head budgets (`policy.ranks_prompt`): once the prompt is read, one ranking of every full-attention
        layer's pairs by their probe estimates decides what each KV head keeps (head_ranking.py, as KVzip's at its
        pass's end); each ranked layer becomes a head store. `hf_kvcompress.prefill` calls it when it ends, and the
        cache itself at the first one-token step (model.generate's path). Once: later calls find nothing to rank."""
        if not self.policy.ranks_prompt:
            return
        scored = [layer for layer in self.layers
                  if layer.policy.needs_hidden_states and layer.is_initialized and not layer.per_head]
        if scored:
            self._rank_heads(scored, self._sliding_extra(scored))

    def _rank_heads(self, scored: list, extra: torch.Tensor | None) -> None:
        """One ranking of the `scored` layers' (KV head, token) pairs decides what each head keeps
        (head_ranking.py); each layer becomes a head store. KVzip's pass end and KVzap's `rank_prompt` come here."""
        sinks = 0 if self.codec.lossless else self.codec.exact_sinks
        # The ranked layers' own policy: under KVzap's planned budget it holds what the sliding layers left them
        # (plan.py `budget_full_tokens`); otherwise the cache's.
        keeps = head_budget_keep(scored[0].policy, scored, sinks, extra=extra, spend=self._spendable(scored, sinks),
                                 floors=self._floors(scored))
        for layer, (priority, keep) in zip(scored, keeps, strict=True):
            layer.rank_heads(priority, keep)
        self.rank_together()

    def rank_together(self) -> None:
        """KVzap's head stores (`policy.ranks_prompt`) hold one allowance while decoding (head_store.py
        `RankedTogether`), as the ranking shared one total among their layers and heads: its decoded tokens are
        scored by the probe and compete with the prompt's pairs of every layer. KVzip's `decoding="evict"` ranks its
        later tokens above every ranked pair (unscored) and still holds each layer's allowance (not measured
        together)."""
        stores = [layer.store for layer in self.layers if isinstance(layer.store, HeadStore)]
        if self.policy.ranks_prompt and len(stores) > 1:
            RankedTogether(stores)

    @property
    def ranked_together(self) -> bool:
        """Whether the ranked layers hold one allowance together (`rank_together`; persist.py records it)."""
        return any(isinstance(layer.store, HeadStore) and layer.store.together is not None for layer in self.layers)

    def _floors(self, scored: list) -> list[torch.Tensor | None] | None:
        """Per scored layer, [B] pairs per KV head it keeps at least (plan.py `SlidingShare.floors`, KVzip's
        calibrated layer floors) or None; None without floors."""
        if self.sliding_share is None or not self.sliding_share.floors:
            return None
        index = {id(layer): i for i, layer in enumerate(self.layers)}
        return [self.sliding_share.floor_count(index[id(layer)], layer.padding.real_seen) for layer in scored]

    def _sliding_extra(self, scored: list) -> torch.Tensor | None:
        """[B] tokens per KV head the scored (full-attention) layers keep beyond the ratio's share, from the pairs the
        sliding layers gave up (plan.py `SlidingShare`); None without a planned share."""
        if self.sliding_share is None or not scored:
            return None
        real_seen = scored[0].padding.real_seen
        return self.sliding_share.extra(real_seen, self.policy.held_per_row(real_seen))

    def _spendable(self, scored: list, sinks: int) -> tuple[torch.Tensor, torch.dtype] | None:
        """([B] bytes the ranked layers' pairs may take, the dtype they are counted in) under KVzip's `bytes=`
        (plan.py `ByteTarget`): the target less what the other layers hold now (the sliding layers have kept their
        newest tokens; a batch's rows are charged an equal share) and the ranked layers' per-row counts."""
        target = self.byte_target
        if target is None:
            return None
        real_seen = scored[0].padding.real_seen
        batch = real_seen.shape[0]
        others = sum(layer.promised_bytes(target.served) for layer in self.layers if layer not in scored)
        counts = sum(head_store_counts(layer.kv_heads, sinks) for layer in scored)
        spent = torch.full_like(real_seen, others // batch + counts)
        spendable = target.spendable(real_seen, spent)
        # Read on the host once per prompt (the ranking's end, not a decode step): a target the plan cannot meet
        # is said, not held silently above.
        if bool((spendable == 0).any()):
            warnings.warn(
                f"bytes={target.share}: on this document ({int(real_seen.min())} tokens) what the plan keeps outside "
                f"the ranking (the sliding layers' newest tokens, exact sinks, the ranked layers' counters) already "
                f"takes more than {target.share} of the uncompressed bytes, so the cache holds more than the target; "
                "the ranked layers keep no pair beyond them. A larger bytes= or a longer document meets it",
                RuntimeWarning, stacklevel=2,
            )
        return spendable, target.served

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
        return cache_spec(self.policy, self.codec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, layers={len(self.layers)})"


class _LayerFactory:
    """Builds the layers of a cache made without a config, numbering them so per-layer codecs (rotation seeds)
    match those of a cache built from the config."""

    def __init__(self, policy: Policy, codec: Codec):
        self.policy, self.codec = policy, codec
        self.built = 0

    def __call__(self) -> CompressedLayer:
        layer = layer_from_plan(unplanned_layer(self.policy, self.codec, self.built))
        self.built += 1
        return layer
