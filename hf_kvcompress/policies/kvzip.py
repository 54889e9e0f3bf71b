"""KVzip: keep what the model needs to reconstruct the context, whatever the question (arXiv:2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy, check_budget_or_ratio, check_count


@dataclass(frozen=True)
class KVzipPolicy(Policy):
    """Score each cached pair by the most attention it gets while the model repeats the context.

    After the context is prefilled, `hf_kvcompress.prefill` has the model read "Repeat the previous context
    exactly." and the context again, in chunks, against the cache (KVzip, Sec. 3.2); a pair's score is the maximum
    attention it receives from those queries and from the query heads of its KV group. Pairs that no query needs
    to rebuild the context are evicted; the reconstruction tokens are never kept. The scores do not depend on the
    question, so one compressed cache answers many. Tokens that arrive later (questions, answers) rank above the
    context; with `ratio` the context gives way to them to keep the share.

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        sink_tokens: first tokens always kept (0 in KVzip).
        layer_budgets: rank the pairs of all full-attention layers together (KVzip, Sec. 3.3) so that layers whose
            pairs score higher keep more of them, under the same total, as whole tokens per head; off: every layer
            keeps the same number.
        head_budgets: rank every (layer, KV head, token) pair together (KVzip's own allocation), so each KV head
            keeps its own number of pairs, stored compactly (caches/head_store.py); needs the 'kvcompress_sdpa'
            attention (per-head masks). The codec's full-precision sink tokens are always kept.
    """

    name: ClassVar[str] = "kvzip"

    budget: int | None = None
    ratio: float | None = None
    sink_tokens: int = 0
    layer_budgets: bool = False
    head_budgets: bool = False
    scores_by_reconstruction: ClassVar[bool] = True

    def __post_init__(self):
        check_count("sink_tokens", self.sink_tokens)
        if not isinstance(self.layer_budgets, bool):
            raise ValueError(f"layer_budgets must be true or false, got {self.layer_budgets!r}")
        if not isinstance(self.head_budgets, bool):
            raise ValueError(f"head_budgets must be true or false, got {self.head_budgets!r}")
        if self.head_budgets and self.layer_budgets:
            raise ValueError("give head_budgets (one ranking of every layer's and head's pairs) or layer_budgets "
                             "(whole tokens per layer), not both")
        check_budget_or_ratio(self, 512, self.sink_tokens)

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        return accumulated
