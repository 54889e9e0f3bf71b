"""Eviction: how many real tokens each row keeps, which slots those are, and the scores that rank them.

A policy evicts down to its budget right away, or after attention when it scores by attention (H2O: the layer's
scorer asks the attention function for statistics and the layer evicts when they arrive, scorers.py) or after a
reconstruction pass (KVzip). Kept
slots stay in token order with each row's padding first; kept tail tokens older than the full-precision tail are
encoded then, for the first and only time.
"""

from __future__ import annotations

import torch

from ..codecs.base import agree_within_groups
from ..policies.base import drop_one, select_kept
from .layer_fields import LayerFields
from .storage import TokenStore


class Eviction(LayerFields):
    """CompressedLayer's eviction (a mixin): keep counts and `_compress` after each step, by the scores the
    layer's scorer provides (scorers.py)."""

    # -- how many tokens stay -----------------------------------------------------------------------------------

    def _keep_per_row(self, before_scoring: bool = False) -> torch.Tensor | None:
        """Real tokens each row keeps now, [B]; None when the policy keeps everything (or waits for its scores).

        `before_scoring`: what a policy that scores by reconstruction will keep once scored, by its uniform budget
        (a per-layer shift comes with the pass's scores), instead of None."""
        if not self.policy.evicts:
            return None
        if not before_scoring and not self.scorer.has_scores:
            return None
        assert self.padding is not None  # a token layer after its first step (a head store evicts by itself)
        keep = self.policy.kept_per_row(self.padding.real_seen)
        return keep if before_scoring or self.budget_shift is None else (keep + self.budget_shift).clamp(min=1)

    def over_budget(self) -> bool:
        """Whether this layer holds more than its policy keeps, even before a reconstruction pass scored it."""
        keep = self._keep_per_row(before_scoring=True)
        return keep is not None and self.stored_tokens > self._most_kept(keep)

    @property
    def _fixed_budget(self) -> bool:
        """Every row keeps the policy's budget (no ratio, no per-layer shift): known on the host."""
        return self.policy.budget is not None and self.budget_shift is None

    def _most_kept(self, keep: torch.Tensor) -> int:
        """keep.max(), known on the host for a fixed budget (no host read of a device value)."""
        budget = self.policy.budget
        return budget if budget is not None and self._fixed_budget else int(keep.max())

    def _most_kept_and_over(self, keep: torch.Tensor) -> tuple[int, bool, bool]:
        """(keep.max(), whether some row holds more real tokens than it keeps, whether every row keeps keep.max()
        real tokens behind no padding), with one host read at most.

        Slots are shared by the batch, so `stored_tokens > keep.max()` alone misses a row whose keep count stands
        still (a ratio held at its sinks + recent floor) while another row's grows: that row must still lose a
        token, or it differs from the row alone. A fixed budget keeps the same count in every row, so there the
        slot count decides. When every row keeps the same count behind no padding, one slot over means one real
        slot dropped in every row, as under a fixed budget (`drop_one`)."""
        budget = self.policy.budget
        if budget is not None and self._fixed_budget:
            return budget, False, True
        assert self.padding is not None  # a token layer after its first step (a head store evicts by itself)
        most = keep.max()
        over = ((self.stored_tokens - self.padding.pads) > keep).any()
        even = (keep == most).all() & (self.padding.pads == 0).all()
        value = int(most * 4 + over.long() * 2 + even.long())  # one read for the three answers
        return value // 4, bool(value & 2), bool(value & 1)

    # -- which tokens stay ----------------------------------------------------------------------------------------

    def _compress(self) -> None:
        if self.policy.drops_blocks:  # a sliding window over per-channel key groups (block_eviction.py)
            self._drop_old_blocks()
            self._encode_tail()
            return
        keep = self._keep_per_row()
        if keep is not None:
            most, row_over, even = self._most_kept_and_over(keep)
            if self.stored_tokens > most or row_over:
                self._evict(keep, most, even)
        self._encode_tail()

    def _evict(self, keep: torch.Tensor, most: int, even: bool) -> None:
        """Keep each row's `keep` [B] best real slots (`most`: keep.max(); `even`: every row keeps `most` real
        slots behind no padding)."""
        # A token layer after its first step: a head store (`rank_heads`) evicts by itself (head_store.py).
        assert isinstance(self.store, TokenStore) and self.padding is not None
        if self.padding.unknown and (self.policy.sink_tokens > 0 or self.policy.needs_attention):
            raise ValueError(
                f"this batch of {self.batch_size} rows was fed without per-row position_ids, so the cache cannot tell "
                "left padding from tokens and eviction would keep padding as attention sinks: pass "
                "position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0) with the attention_mask, or use generate() "
                "or hf_kvcompress.generation.prefill"
            )
        self.padding.evicting()
        length = self.stored_tokens
        keys = self._full("key") if self.policy.needs_keys else None
        extra = self.scorer.score_inputs(self)  # what the scorer keeps for the policy (queries=), handed only to it
        if self.policy.needs_values:
            extra["values"] = self._full("value")
        scores = self.policy.score(
            self.slots.accumulated, length, keys=keys, positions=self.slots.positions, pads=self.padding.pads, **extra
        )
        scores = agree_within_groups(scores, self.codec.heads_per_store)
        if length == most + 1 and even:
            # A decode step: one slot over (a fixed budget, or every row keeps as many real slots).
            kept = drop_one(self.policy, scores, self.padding.pads, self.kv_heads, length)
        else:
            kept = select_kept(
                self.policy, scores, self.padding.pads, self.kv_heads, length, keep, most
            )  # [B, H_kv, budget]
        budget = kept.shape[-1]
        if self.store.encoded_keys is None:
            self._capture_sinks()
        self.slots.take(kept)  # scores, positions and sink slots follow the kept slots
        self.padding.kept(budget, keep, length)
        rerotate = self.store.encoded_keys is None and self.inv_freq is not None
        self.store.take(kept)
        if rerotate:
            self._rerotate_kept()
