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


def head_budget_keep(
    policy: Policy, layers: list, codec_sinks: int = 0, extra: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (priority [B, H, T] with protected pairs at +inf and padding at -inf, keep [B, H, T] bool).

    The policy's sinks and the codec's (`codec_sinks` first real tokens, kept exact beside the store) are
    protected. Each row keeps `(policy.kept_per_row(real tokens) + extra) x heads x layers` pairs in all (fewer when
    it has fewer real pairs; `extra` [B]: what a hybrid model's sliding layers gave up, plan.py `SlidingShare`);
    ties go to the pair ranked first (lower layer, head, token)."""
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
    per_head = policy.kept_per_row(layers[0].padding.real_seen)
    wanted = (per_head if extra is None else per_head + extra) * heads * len(layers)
    total = torch.minimum(torch.maximum(wanted, protected), real)
    keep = ranked_first(flat, total[:, None])
    out, start = [], 0
    for p, chosen, recent in zip(priorities, chosen_by, newest, strict=True):
        size = p[0].numel()
        layer_keep = keep[:, start : start + size].view_as(p)
        if chosen is not p:  # the raw ranking sets how many pairs each head keeps, the policy's score which
            layer_keep = ranked_first(chosen, layer_keep.sum(-1, keepdim=True))
        out.append((chosen.masked_fill(recent[:, None, :], RECENT_SCORE), layer_keep))
        start += size
    return out


def _protected(policy: Policy, scores: torch.Tensor | None, layer, codec_sink: torch.Tensor) -> torch.Tensor:
    """The policy's priority of a layer's slots (`slot_priority`), with the codec's sinks protected too."""
    priority = slot_priority(policy, scores, layer.padding.pads, layer.kv_heads, layer.stored_tokens)
    return priority.masked_fill(codec_sink[:, None, :], float("inf"))
