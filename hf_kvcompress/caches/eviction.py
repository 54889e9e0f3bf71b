"""Eviction: how many real tokens each row keeps, and which slots those are.

A policy evicts down to its budget right away, or after attention when it scores by attention (H2O: the layer's
scorer asks the attention function for statistics and the layer evicts when they arrive, scorers.py) or after a
reconstruction pass (KVzip). Kept slots stay in token order with each row's padding first; the layer then moves its
store, per-slot records and padding along (layer.py `_evict`), and encodes kept tail tokens older than the
full-precision tail, for the first and only time.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from ..codecs.base import agree_within_groups
from ..policies.base import Policy, drop_one, select_kept
from .padding import RowPadding

UNKNOWN_PADDING = (
    "this batch of {rows} rows was fed without per-row position_ids, so the cache cannot tell left padding from "
    "tokens and eviction would keep padding as attention sinks: pass "
    "position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) with the attention_mask, or use generate() or "
    "hf_kvcompress.generation.prefill"
)


# Set by generation.prefill(compress=False): the step's tokens follow a prompt the cache has compressed (a question
# after its document), and a policy that `appends_question` appends them unscored.
APPENDED_PROMPT: ContextVar[bool] = ContextVar("APPENDED_PROMPT", default=False)


class Eviction:
    """A layer's keep counts: the policy's budget per row, plus `budget_shift` [B] (tokens this layer keeps beyond
    the uniform budget, set by a reconstruction pass's allocation across layers, compressed.py), and the choice of
    the kept slots from the policy's scores."""

    def __init__(self, policy: Policy, heads_per_store: int) -> None:
        self.policy = policy
        self.heads_per_store = heads_per_store  # KV heads a codec stores together must keep the same slots
        self.budget_shift: torch.Tensor | None = None

    def appends(self, new: int) -> bool:
        """Whether a step of `new` tokens joins what is kept unscored and evicts nothing: a decode step of a policy
        that does not evict while decoding (SnapKV's `decoding="append"`), or, for a policy that `appends_question`,
        any step prefilled after the compressed prompt (APPENDED_PROMPT)."""
        if self.policy.evicts_while_decoding:
            return False
        return new == 1 or (self.policy.appends_question and APPENDED_PROMPT.get())

    def keep_per_row(self, padding: RowPadding, has_scores: bool, before_scoring: bool = False) -> torch.Tensor | None:
        """Real tokens each row keeps now, [B]; None when the policy keeps everything (or waits for its scores).

        `before_scoring`: what a policy that scores by reconstruction will keep once scored, by its uniform budget
        (a per-layer shift comes with the pass's scores), instead of None."""
        if not self.policy.evicts:
            return None
        if not before_scoring and not has_scores:
            return None
        keep = self.policy.kept_per_row(padding.real_seen)
        return keep if before_scoring or self.budget_shift is None else (keep + self.budget_shift).clamp(min=1)

    def over_budget(self, padding: RowPadding, stored_tokens: int) -> bool:
        """Whether the layer holds more than its policy keeps, even before a reconstruction pass scored it."""
        keep = self.keep_per_row(padding, has_scores=False, before_scoring=True)
        return keep is not None and stored_tokens > self.most_kept(keep)

    @property
    def fixed_budget(self) -> bool:
        """Every row keeps the policy's budget (no ratio, no per-layer shift): known on the host."""
        return self.policy.budget is not None and self.budget_shift is None

    def most_kept(self, keep: torch.Tensor) -> int:
        """keep.max(), known on the host for a fixed budget (no host read of a device value)."""
        budget = self.policy.budget
        return budget if budget is not None and self.fixed_budget else int(keep.max())

    def due(self, padding: RowPadding, has_scores: bool, stored_tokens: int) -> tuple[torch.Tensor, int, bool] | None:
        """(keep per row, keep.max(), whether every row keeps keep.max() real tokens behind no padding) when the
        layer must evict now, else None; one host read at most.

        Slots are shared by the batch, so `stored_tokens > keep.max()` alone misses a row whose keep count stands
        still (a ratio held at its sinks + recent floor) while another row's grows: that row must still lose a
        token, or it differs from the row alone. A fixed budget keeps the same count in every row, so there the
        slot count decides. When every row keeps the same count behind no padding, one slot over means one real
        slot dropped in every row, as under a fixed budget (`drop_one`)."""
        if self.appends(padding.step_tokens):
            return None
        keep = self.keep_per_row(padding, has_scores)
        if keep is None:
            return None
        budget = self.policy.budget
        if budget is not None and self.fixed_budget:
            return (keep, budget, True) if stored_tokens > budget else None
        most = keep.max()
        over = ((stored_tokens - padding.pads) > keep).any()
        even = (keep == most).all() & (padding.pads == 0).all()
        value = int(most * 4 + over.long() * 2 + even.long())  # one read for the three answers
        most_kept, row_over, same = value // 4, bool(value & 2), bool(value & 1)
        return (keep, most_kept, same) if stored_tokens > most_kept or row_over else None

    def slides(self, scores: torch.Tensor | None, length: int, most: int, even: bool) -> bool:
        """Whether this eviction drops one slot per row by recency alone, as a window sliding by one token (`choose`
        takes `drop_one` without scores): each row drops its newest padding slot, or else the slot after its sinks
        (`recency_drop`, which needs a real slot older than the recent window: known on the host)."""
        policy = self.policy
        return scores is None and length == most + 1 and even and policy.sink_tokens + policy.recent < length

    def refuse_unknown_padding(self, padding: RowPadding) -> None:
        """Eviction that keeps sinks or scores by attention must know where each row's padding ends."""
        if padding.unknown and (self.policy.sink_tokens > 0 or self.policy.needs_attention):
            raise ValueError(UNKNOWN_PADDING.format(rows=padding.batch_size))

    def choose(
        self, padding: RowPadding, scores: torch.Tensor | None, kv_heads: int, length: int, keep: torch.Tensor,
        most: int, even: bool,
    ) -> torch.Tensor:
        """The kept slots [B, H_kv, budget], in token order with each row's padding first, from the policy's
        `scores` [B, H_kv, length] (None: the policy ranks by recency alone); `most` and `even` as `due` says."""
        scores = agree_within_groups(scores, self.heads_per_store)
        if length == most + 1 and even:  # a decode step: one slot over, the same real slot count in every row
            return drop_one(self.policy, scores, padding.pads, kv_heads, length)
        return select_kept(self.policy, scores, padding.pads, kv_heads, length, keep, most)

    # -- persistence and batch selection (save_cache names it `budget_shift`) ------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.budget_shift is None else {"budget_shift": self.budget_shift}

    def load_state(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        shift = tensors.get("budget_shift")
        self.budget_shift = None if shift is None else shift.to(device, copy=True)

    def select_rows(self, indices: torch.Tensor) -> None:
        if self.budget_shift is not None:
            self.budget_shift = self.budget_shift.index_select(0, indices)

    def nbytes(self) -> int:
        shift = self.budget_shift
        return 0 if shift is None else shift.numel() * shift.element_size()
