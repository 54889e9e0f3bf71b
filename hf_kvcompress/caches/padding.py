"""Left padding in a batch: how many padding slots each row keeps at its front, and the masks that follow from it.

Slots stay in token order with each row's padding first, so transformers' shared mask lines up with what a layer
keeps as long as every padded row keeps all its real tokens; when it cannot (a ratio in a padded batch, per-layer
budgets) the layer hands attention its own mask. Chunked prefills and per-channel key groups can make a padded row
differ from the row alone: those cases warn.
"""

from __future__ import annotations

import warnings
from contextvars import ContextVar

import torch

from .requests import ENABLE_ATTENTION_HINT, MASK_KEY, OwnMask

# Set by generation.prefill while it feeds a prompt in chunks aligned to the prompt's end (see there).
END_ALIGNED_CHUNKS: ContextVar[bool] = ContextVar("END_ALIGNED_CHUNKS", default=False)

CHUNKS_SPLIT_PADDED_ROWS = (
    "this left-padded batch was prefilled in chunks counted from its start (generate(prefill_chunk_size=...)) and "
    "the cache evicted between chunks: each padded row's chunks start at another token than they would for the row "
    "alone, so its eviction points, and possibly its answer, differ from the row alone. Prefill with "
    "hf_kvcompress.prefill(model, input_ids, attention_mask, cache, chunk_size=...) (chunks aligned to the prompt's "
    "end: padded rows equal rows alone) or without prefill_chunk_size"
)

PADDING_SPLITS_GROUPS = (
    "per-channel key groups of {group} tokens span left padding in this batch: a row whose padding is not a "
    "multiple of {group} is quantized in other groups than when run alone, so its answer can differ slightly from "
    "the row alone; use key_axis='token' (exact row equivalence) or batch rows of equal length"
)


class RowPadding:
    """CompressedLayer's padding bookkeeping (a mixin): `pads` and `real_seen` per row, and its own masks."""

    def _count_padding(self, attn_kwargs: dict | None, new: int) -> None:
        """Count each row's left padding from its position ids: real tokens count up from 0, padding comes first.

        Padding sits at position 0 in transformers 5.24's generate() and at 1 in our prefill. With 0, a chunk that
        ends in padding looks like padding + a row's first token, so a row's only token stays provisional until the
        next chunk shows whether it starts again at 0 (it was padding) or goes on at 1.
        """
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != new:
            position_ids = None
        if position_ids is None or (position_ids.shape[0] == 1 and self.batch_size > 1):
            # No per-row positions (a forward without position_ids): padding, if any, cannot be told apart.
            if self.seen == 0 and self.batch_size > 1:
                self.padding_unknown = True
            self.real_seen += new
            return
        positions = position_ids.to(self.device).long()
        if new == 1:  # a decode step: the general case below, for one token, in a few operations
            at_zero = positions[:, 0] == 0
            was_padding = ((self.real_seen == 1) & at_zero).long()
            self.pads += was_padding
            self.real_seen -= was_padding
            real = ((self.real_seen > 0) | at_zero).long()
            self.pads += 1 - real
            self.real_seen += real
            return
        was_padding = (self.real_seen == 1) & (positions[:, 0] == 0)
        self.pads += was_padding.long()
        self.real_seen -= was_padding.long()
        started = self.real_seen > 0
        # The run at the chunk's end that counts up by one: the row's real tokens, unless it does not start at 0.
        counts_up = (positions[:, 1:] - positions[:, :-1]) == 1  # [B, new - 1]
        run = counts_up.flip(-1).long().cumprod(-1).sum(-1) + 1
        run_start = positions.gather(1, (new - run)[:, None]).squeeze(1)
        offset_row = (run == new) & (new > 1)  # positions that count up without padding, from any offset
        fresh = torch.where(run_start == 0, run, torch.where(offset_row, run, torch.zeros_like(run)))
        real = torch.where(started, torch.full_like(run, new), fresh)
        self.pads += new - real
        self.real_seen += real

    def _check_chunk_alignment(self, new: int) -> None:
        """Warn when a padded batch's prompt chunks, counted from its start, split rows unlike the rows alone."""
        self.step_tokens = new
        if new == 1:
            self.evicted_mid_prompt = False
            return
        if not self.evicted_mid_prompt or END_ALIGNED_CHUNKS.get() or self.batch_size == 1:
            return
        padding = self.seen - self.real_seen
        if bool((padding != padding[0]).any()):
            warnings.warn(CHUNKS_SPLIT_PADDED_ROWS, UserWarning, stacklevel=3)
        self.evicted_mid_prompt = False

    def _shared_mask_misplaces_padding(self, length: int) -> bool:
        """Whether transformers' mask, built from the 2-D padding mask and one offset for the whole batch, masks
        other slots than the padding this layer keeps. It fits while each padded row keeps all its real tokens (a
        fixed budget); a ratio makes a padded row keep a share of them and some padding, which it cannot express."""
        if self.budget_shift is None and self.policy.ratio is None and self.step_tokens == 1 and not self.mask_misplaced:
            # A decode step adds one slot and one token seen to every row (offset unchanged) and moves padding and
            # real counts alike, so the answer holds from the last step; a fixed budget (or none) also keeps it
            # false through eviction (each row keeps min(budget, real) real slots behind its padding). Not asking
            # again saves a host read per layer per step.
            return False
        offset = self.seen - length  # tokens seen minus slots attention sees, the same for every row
        expected = (self.seen - self.real_seen - offset).clamp(min=0, max=length)
        self.mask_misplaced = bool((expected != self.pads).any())
        return self.mask_misplaced

    def _own_mask(self, attn_kwargs: dict | None, new: int, length: int) -> None:
        """Give attention this layer's [B, 1, new, length] mask (its padding first, causal over the new tokens, within
        a sliding layer's `attention_window`): transformers' one mask cannot fit when layers keep different numbers
        of tokens or rows different shares."""
        if attn_kwargs is None:
            raise RuntimeError("this cache needs the attention kwargs that transformers passes to cache layers")
        slot = torch.arange(length, device=self.device)
        query_slot = length - new + torch.arange(new, device=self.device)
        visible = slot[None, :] <= query_slot[:, None]  # [new, length]
        if self.attention_window is not None:  # slots stay the newest tokens in order: distance in slots is in tokens
            visible = visible & (slot[None, :] > query_slot[:, None] - self.attention_window)
        allowed = visible[None] & (slot[None, :] >= self.pads[:, None])[:, None, :]
        self.own_mask = OwnMask(allowed[:, None])
        attn_kwargs[MASK_KEY] = self.own_mask

    def check_mask_used(self) -> None:
        """Refuse to go on when the last step's own mask was ignored (the model does not use our attention)."""
        if self.own_mask is not None and not self.own_mask.used:
            self.own_mask = None
            raise RuntimeError(
                f"{type(self.policy).__name__} with a ratio in a padded batch (or per-layer budgets) keeps what "
                f"transformers' shared attention mask cannot describe: {ENABLE_ATTENTION_HINT}"
            )
        self.own_mask = None
