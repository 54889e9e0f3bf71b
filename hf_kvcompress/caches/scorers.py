"""How a layer learns the scores its policy ranks slots by, chosen once when the layer is built.

Each scorer does its part of a step after the new tokens are stored (`begin_step`) and says whether eviction waits
for attention: a policy that scores by attention statistics (H2O, SnapKV, TOVA) or by the newest queries (Expected
Attention) evicts when our attention function delivers them (`CompressedLayer.observe`, `observe_queries`), the
others right away. `CompressedLayer.update` runs the same pipeline for every policy and asks its scorer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policies.base import Policy
from .requests import AttentionRequest

if TYPE_CHECKING:
    from .layer import CompressedLayer

# Scores of tokens that arrive after a reconstruction pass start here: above any attention probability, newest first.
AFTER_RECONSTRUCTION = 2.0


class NoScores:
    """Recency, keys, values or positions: everything `policy.score` reads is stored already."""

    def begin_step(self, layer: "CompressedLayer", attn_kwargs: dict | None, new: int) -> bool:
        """Do this scorer's part of a step of `new` tokens; True: eviction waits for attention to deliver."""
        return False


class AttentionStatistics(NoScores):
    """`policy.needs_attention`: each new slot starts at 0 in `slots.accumulated`; attention delivers the step's
    statistics to `layer.observe`, which folds them in (`policy.observe`) and evicts."""

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        layer._grow_accumulated(new)
        policy = layer.policy
        layer._request_attention(attn_kwargs, AttentionRequest(
            layer.observe, policy.observed_queries, policy.attention_reduction
        ))
        return True


class RecentQueries(NoScores):
    """`policy.needs_queries` (Expected Attention): attention delivers the step's newest queries to
    `layer.observe_queries`, which keeps them (query_window.py) and evicts."""

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        layer._request_queries(attn_kwargs, new)
        return True


class ReconstructionScores(NoScores):
    """`policy.scores_by_reconstruction` (KVzip): the pass scores the slots (reconstruction.py); tokens after it
    rank above the context, newest first."""

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        if layer.scored:
            layer._grow_accumulated(new, fill_from=AFTER_RECONSTRUCTION + layer.seen)
        return False


def scorer_for(policy: Policy) -> NoScores:
    """The scorer a layer with `policy` uses (the queries first: Expected Attention sets both attention flags)."""
    if policy.needs_queries:
        return RecentQueries()
    if policy.needs_attention:
        return AttentionStatistics()
    if policy.scores_by_reconstruction:
        return ReconstructionScores()
    return NoScores()
