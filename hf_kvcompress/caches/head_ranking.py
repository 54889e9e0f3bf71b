"""One ranking of every (layer, KV head, token) pair of a row: KVzip's head budgets (Sec. 3.3; Ada-KV's idea).

Reconstruction scores are attention probabilities, comparable across heads and layers, so the row keeps its
`layers x heads x per-head share` best pairs wherever they are: a head the context needs keeps many, a head that
only attends locally keeps few. Measured on our needle prompts (benchmarks/kvzip_budget_allocation.py): the same
share kept per head loses every needle in the document's first tenth on SmolLM2; this ranking keeps them.
"""

from __future__ import annotations

from typing import cast

import torch

from ..policies.base import Policy, ranked_first, slot_priority

RECENT_SCORE = 1.5  # attention probabilities are at most 1; tokens after the ranking score 2 and more
FLOORED = float(torch.finfo(torch.float32).max)  # a floored pair's rank (`head_budget_keep`): above any score
SCORE_BYTES = 4  # each pair a head store keeps carries its float32 score (head_store.py `RaggedHeads`)


def head_budget_keep(
    policy: Policy, layers: list, codec_sinks: int = 0, extra: torch.Tensor | None = None,
    spend: tuple[torch.Tensor, torch.dtype] | None = None, floors: list[torch.Tensor | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (priority [B, H, T] with protected pairs at +inf and padding at -inf, keep [B, H, T] bool).

    The policy's sinks and the codec's (`codec_sinks` first real tokens, kept exact beside the store) are
    protected. Each row keeps `(policy.kept_per_row(real tokens) + extra) x heads x layers` pairs in all (fewer when
    it has fewer real pairs; `extra` [B]: what a hybrid model's sliding layers gave up, plan.py `SlidingShare`);
    ties go to the pair ranked first (lower layer, head, token). `spend` ([B] bytes, dtype; KVzip's `bytes=`, plan.py
    `ByteTarget`): instead, each row keeps its best pairs while their bytes in that dtype (`pair_bytes`) fit.
    `floors` (per layer, [B] or None; plan.py `SlidingShare.floors`): each KV head of that layer keeps at least its
    best that many pairs (by the raw priority) before the ranking shares out the rest, within the same total; when
    the floors alone pass the total, the earlier layers' floors are met first."""
    priorities, chosen_by, newest = [], [], []
    for layer in layers:
        length = layer.stored_tokens
        slot = torch.arange(length, device=layer.device)
        pads = layer.padding.pads[:, None]
        codec_sink = (slot[None, :] >= pads) & (slot[None, :] < pads + codec_sinks)
        priorities.append(_protected(policy, layer.slots.accumulated, layer, codec_sink))
        scores = policy.score(layer.slots.accumulated, length)  # KVzip's span: chooses which pairs, not how many
        same = scores is layer.slots.accumulated
        chosen_by.append(priorities[-1] if same else _protected(policy, scores, layer, codec_sink))
        # The document's `recent` newest tokens are kept now; later they rank like the newest context, not like
        # sinks (never evicted): above every attention score, below every later token.
        newest.append((slot >= length - policy.recent) & (slot >= pads + max(policy.sink_tokens, codec_sinks)))
    flat = torch.cat([p.flatten(1) for p in priorities], dim=1)  # [B, L * H * T]
    heads = layers[0].kv_heads
    # Sums of one tensor per layer (at least one): tensors. [B] real pairs of the row; [B] sinks: never evicted.
    real = cast(torch.Tensor, sum((p > float("-inf")).flatten(1).sum(1) for p in priorities))
    protected = cast(torch.Tensor, sum((p == float("inf")).flatten(1).sum(1) for p in priorities))
    if spend is None:
        per_head = policy.kept_per_row(layers[0].padding.real_seen)
        wanted = (per_head if extra is None else per_head + extra) * heads * len(layers)
    else:
        costs = torch.cat([pair_bytes(layer, codec_sinks, spend[1]).flatten(1) for layer in layers], dim=1)
        wanted = affordable(flat, costs, spend[0])
    total = torch.minimum(torch.maximum(wanted, protected), real)
    ranked = flat
    if floors is not None and any(f is not None for f in floors):
        # A floor's pairs rank above every score and below the protected pairs (+inf); the others keep their place.
        lifted = [p if f is None else p.masked_fill(ranked_first(p, f[:, None, None]) & (p < float("inf")), FLOORED)
                  for p, f in zip(priorities, floors, strict=True)]
        ranked = torch.cat([p.flatten(1) for p in lifted], dim=1)
    keep = ranked_first(ranked, total[:, None])
    out, start = [], 0
    for p, chosen, recent in zip(priorities, chosen_by, newest, strict=True):
        size = p[0].numel()
        layer_keep = keep[:, start : start + size].view_as(p)
        if chosen is not p:  # the raw ranking sets how many pairs each head keeps, the policy's score which
            layer_keep = rechosen(chosen, layer_keep, None if spend is None else residual_slots(layer))
        out.append((chosen.masked_fill(recent[:, None, :], RECENT_SCORE), layer_keep))
        start += size
    return out


def pair_bytes(layer, codec_sinks: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, T]: the bytes in `dtype` each of a token layer's slots takes once a head store keeps it
    (head_store.py `promised_bytes`): a slot the token store has encoded (every slot under a lossless codec, whose
    store is its encoding) at the codec's rate, one still within the codec's full-precision residual at full
    precision, each with its score; a codec sink at full precision beside the pairs, without one. Padding: 0."""
    codec = layer.codec
    element = torch.empty((), dtype=dtype).element_size()
    encoded = (codec.bytes_per_token(layer.head_dim, "key", dtype)
               + codec.bytes_per_token(layer.value_dim, "value", dtype))
    exact = (layer.head_dim + layer.value_dim) * element
    slot = torch.arange(layer.stored_tokens, device=layer.device)
    cost = torch.where(residual_slots(layer), exact + SCORE_BYTES, encoded + SCORE_BYTES).double()[None, :]
    pads = layer.padding.pads[:, None]
    cost = torch.where((slot[None, :] >= pads) & (slot[None, :] < pads + codec_sinks), float(exact), cost)
    cost = cost.masked_fill(slot[None, :] < pads, 0.0)
    return cost[:, None, :].expand(-1, layer.kv_heads, -1)


def residual_slots(layer) -> torch.Tensor:
    """[T] bool: the slots of a token layer still within its codec's full-precision residual (none under a lossless
    codec, whose store is its encoding): a head store keeps them at full precision, the others at the codec's rate."""
    slot = torch.arange(layer.stored_tokens, device=layer.device)
    return slot >= (layer.stored_tokens if layer.codec.lossless else layer.store.n_encoded)


def rechosen(chosen: torch.Tensor, keep: torch.Tensor, classes: torch.Tensor | None) -> torch.Tensor:
    """[B, H, T]: each head keeps as many pairs as `keep` does, the best by `chosen` (KVzip's span scores). With
    `classes` ([T] bool: full-precision slots, `residual_slots`) as many of each class as `keep` holds, so the
    pairs cost the bytes the ranking paid for them (`bytes=`): a re-choice that moved pairs from the encoded slots
    to the dearer residual would hold more than the target."""
    if classes is None:
        return ranked_first(chosen, keep.sum(-1, keepdim=True))
    out = torch.zeros_like(keep)
    for within in (classes, ~classes):
        counts = (keep & within).sum(-1, keepdim=True)
        out |= ranked_first(chosen.masked_fill(~within, float("-inf")), counts)
    return out


def affordable(priority: torch.Tensor, costs: torch.Tensor, spend: torch.Tensor) -> torch.Tensor:
    """[B]: how many of each row's best `priority` [B, N] pairs (ties: the first first, as `ranked_first`) fit in
    `spend` [B] bytes, pair i taking `costs` [B, N]."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    spent = costs.gather(-1, order).cumsum(-1)
    return (spent <= spend[:, None].double()).sum(-1)


def _protected(policy: Policy, scores: torch.Tensor | None, layer, codec_sink: torch.Tensor) -> torch.Tensor:
    """The policy's priority of a layer's slots (`slot_priority`), with the codec's sinks protected too."""
    priority = slot_priority(policy, scores, layer.padding.pads, layer.kv_heads, layer.stored_tokens)
    return priority.masked_fill(codec_sink[:, None, :], float("inf"))
