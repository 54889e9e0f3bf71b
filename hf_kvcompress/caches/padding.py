"""Left padding in a batch: how many padding slots each row keeps at its front, and the masks that follow from it.

Slots stay in token order with each row's padding first, so transformers' shared mask lines up with what a layer
keeps as long as every padded row keeps all its real tokens; when it cannot (a ratio in a padded batch, per-layer
budgets) the layer hands attention its own mask (`RowPadding.mask`). Chunked prefills and per-channel key groups
can make a padded row differ from the row alone: those cases warn.
"""

from __future__ import annotations

import warnings
from contextvars import ContextVar

import torch

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
    """One layer's padding bookkeeping, owned by the layer (`layer.padding`, built at its first step).

    `pads` [B]: padding slots kept at the front of each row; `real_seen` [B]: real (non-padding) tokens each row has
    seen; `unknown`: a batch fed without per-row position ids, whose padding cannot be counted; `step_tokens`: the
    tokens of the step being stored. Eviction and the block window move `pads` through `kept` and `drop`, crop
    through `crop`, beam search through `select_rows`.
    """

    def __init__(
        self, batch: int, device: torch.device, pads: torch.Tensor | None = None,
        real_seen: torch.Tensor | None = None, unknown: bool = False,
    ):
        self.pads = torch.zeros(batch, dtype=torch.long, device=device) if pads is None else pads
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=device) if real_seen is None else real_seen
        self.unknown = unknown
        self.step_tokens = 0
        self.evicted_mid_prompt = False  # evicted after a multi-token step that more prompt chunks may follow
        self.mask_misplaced = True  # the last `misplaces_shared_mask` answer (True: ask again)
        # `real_seen` itself once every row had two real tokens or more (learnt with `misplaces_shared_mask`'s host
        # read): a decode step then adds one real token to each row and no padding, whatever its position (`count`).
        # A reassigned `real_seen` is not this tensor, and `count`'s general steps forget it.
        self.settled: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.pads.shape[0]

    @property
    def prompt_step(self) -> bool:
        """The step being stored brings more than one token (a prompt or a chunk of one), which may add padding."""
        return self.step_tokens > 1

    def count(self, attn_kwargs: dict | None, new: int, seen: int) -> None:
        """Count each row's left padding from its position ids (`seen`: tokens the layer saw before this step): real
        tokens count up from 0, padding comes first.

        Padding sits at position 0 in transformers 5.24's generate() and at 1 in our prefill. With 0, a chunk that
        ends in padding looks like padding + a row's first token, so a row's only token stays provisional until the
        next chunk shows whether it starts again at 0 (it was padding) or goes on at 1.
        """
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != new:
            position_ids = None
        if position_ids is None or (position_ids.shape[0] == 1 and self.batch_size > 1):
            # No per-row positions (a forward without position_ids): padding, if any, cannot be told apart.
            if seen == 0 and self.batch_size > 1:
                self.unknown = True
            self.real_seen += new
            return
        if new == 1 and self.settled is self.real_seen:
            self.real_seen += 1  # in place: still `settled`
            return
        positions = position_ids.to(self.pads.device).long()
        self.settled = None  # the steps below may take a real token back (`was_padding`)
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

    def check_chunk_alignment(self, new: int, seen: int) -> None:
        """Start a step of `new` tokens; warn when a padded batch's prompt chunks, counted from its start, split
        rows unlike the rows alone."""
        self.step_tokens = new
        if new == 1:
            self.evicted_mid_prompt = False
            return
        if not self.evicted_mid_prompt or END_ALIGNED_CHUNKS.get() or self.batch_size == 1:
            return
        padding = seen - self.real_seen
        if bool((padding != padding[0]).any()):
            warnings.warn(CHUNKS_SPLIT_PADDED_ROWS, UserWarning, stacklevel=3)
        self.evicted_mid_prompt = False

    def evicting(self) -> None:
        """The layer evicts now: after a prompt step, more chunks may follow (`check_chunk_alignment`)."""
        self.evicted_mid_prompt = self.prompt_step

    def misplaces_shared_mask(self, seen: int, length: int, shares_may_change: bool) -> bool:
        """Whether transformers' mask, built from the 2-D padding mask and one offset for the whole batch, masks
        other slots than the padding this layer keeps (`length` slots, `seen` tokens). It fits while each padded row
        keeps all its real tokens (a fixed budget); a ratio (or a per-layer shift: `shares_may_change`) makes a
        padded row keep a share of them and some padding, which it cannot express."""
        if not shares_may_change and self.step_tokens == 1 and not self.mask_misplaced:
            # A decode step adds one slot and one token seen to every row (offset unchanged) and moves padding and
            # real counts alike, so the answer holds from the last step; a fixed budget (or none) also keeps it
            # false through eviction (each row keeps min(budget, real) real slots behind its padding). Not asking
            # again saves a host read per layer per step.
            return False
        offset = seen - length  # tokens seen minus slots attention sees, the same for every row
        expected = (seen - self.real_seen - offset).clamp(min=0, max=length)
        misplaced = (expected != self.pads).any()
        both = int(misplaced.long() * 2 + (self.real_seen.min() >= 2).long())  # one host read for both answers
        self.mask_misplaced = both >= 2
        self.settled = self.real_seen if both % 2 else None  # read with this answer: decode steps `count` less
        return self.mask_misplaced

    def mask(self, new: int, length: int, window: int | None) -> torch.Tensor:
        """[B, 1, new, length] bool: each row's slots after its padding, causal over the `new` newest slots, and
        within a sliding layer's attention `window` (slots stay the newest tokens in order, so a distance in slots
        is one in tokens)."""
        device = self.pads.device
        slot = torch.arange(length, device=device)
        query_slot = length - new + torch.arange(new, device=device)
        visible = slot[None, :] <= query_slot[:, None]  # [new, length]
        if window is not None:
            visible = visible & (slot[None, :] > query_slot[:, None] - window)
        allowed = visible[None] & (slot[None, :] >= self.pads[:, None])[:, None, :]
        return allowed[:, None]

    # -- moves: the padding slots follow the slots --------------------------------------------------------------

    def kept(self, budget: int, keep: torch.Tensor, length: int, fixed_budget: bool) -> None:
        """After eviction keeps `budget` slots of `length`, each row `keep[b]` real tokens at most behind padding.

        Under a fixed budget every row keeps min(budget, real) real slots behind its padding, so whether
        transformers' mask fits is unchanged; any other keep (a ratio, a per-layer shift) may leave a padded row with
        a share of its tokens, and the last `misplaces_shared_mask` answer, read before this eviction, is stale:
        ask again at the next step (a ratio whose decode steps append would otherwise attend the padding it keeps)."""
        self.pads = budget - torch.minimum(keep, length - self.pads)
        if not fixed_budget:
            self.mask_misplaced = True

    def drop(self, n: int) -> None:
        """The `n` oldest slots are dropped (a block window): padding is the oldest slots."""
        self.pads = (self.pads - n).clamp(min=0)

    def crop(self, keep: int) -> None:
        """Only the `keep` oldest slots (every token seen, nothing evicted) remain."""
        self.pads = self.pads.clamp(max=keep)
        self.real_seen = keep - self.pads
        self.settled = None  # a row may now hold fewer than two real tokens; the old tensor is not held on to

    def select_rows(self, indices: torch.Tensor) -> None:
        # The rows kept are rows that were settled (two real tokens or more), so a settled count stays settled; it
        # must name the new tensor, or it would hold the old one (bytes that `nbytes` does not promise).
        settled = self.settled is self.real_seen
        self.pads = self.pads.index_select(0, indices)
        self.real_seen = self.real_seen.index_select(0, indices)
        self.settled = self.real_seen if settled else None

    # -- saving, loading and bytes ----------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        return {"pads": self.pads, "real_seen": self.real_seen}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], unknown: bool, device: torch.device) -> RowPadding:
        pads, real_seen = (tensors[name].to(device, copy=True) for name in ("pads", "real_seen"))
        return cls(pads.shape[0], pads.device, pads=pads, real_seen=real_seen, unknown=unknown)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pads, self.real_seen))
