"""A policy decides which tokens stay in the cache: protected sinks and recent tokens, then the best-scored rest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..spec_text import changed_fields, join_spec


@dataclass(frozen=True)
class Policy:
    """Which kept slots survive when a layer holds more than its budget of tokens per KV head.

    Subclasses set `budget` (tokens) or `ratio` (share of the tokens seen), `sink_tokens` and `recent` and, if
    recency is not the criterion, `score()`. The layer owns all state; the policy is a frozen description, so one
    instance serves every layer.
    """

    # Tokens each sliding-window layer keeps (its newest), on models that mix sliding and full attention (Gemma 3),
    # whatever the budget or ratio; None: the budget or ratio's share of the window (caches/compressed.py,
    # `sliding_kept`). Keyword-only, so every policy has it and positional arguments keep their meaning.
    sliding: int | None = field(default=None, kw_only=True)

    name: ClassVar[str] = ""  # the registry's name for the policy (`h2o`), the head of its spec string
    needs_attention: ClassVar[bool] = False  # True: the layer must receive attention statistics (see hf/attention.py)
    attention_reduction: ClassVar[str] = "sum"  # how a step's queries are reduced per key: "sum" or "max"
    needs_keys: ClassVar[bool] = False  # score() reads the kept keys
    needs_positions: ClassVar[bool] = False  # score() reads each kept slot's position
    scores_by_reconstruction: ClassVar[bool] = False  # KVzip: scored by generation.prefill's reconstruction pass
    needs_queries: ClassVar[bool] = False  # score() reads the newest queries (RecentQueries), not attention statistics
    needs_values: ClassVar[bool] = False  # score() reads the kept values
    needs_hidden_states: ClassVar[bool] = False  # scored from the hidden state entering attention (KVzap's probe)
    # Fields whose spec value "none" is a value of its own, distinct from the field's None default (a spec reads
    # "none" as None everywhere else): KVzip's and KVzap's `floors=none` ranks without floors, None reads the
    # shipped file (registry.py `_build`).
    spec_none_is_text: ClassVar[tuple[str, ...]] = ()

    @property
    def budget(self) -> int | None:
        """Tokens kept per KV head after eviction; None keeps everything (or follows `ratio`)."""
        return None

    @property
    def ratio(self) -> float | None:
        """Share of the tokens seen that is kept; None when `budget` is used."""
        return None

    @property
    def sink_tokens(self) -> int:
        return 0

    @property
    def recent(self) -> int:
        return 0

    @property
    def observed_queries(self) -> int | None:
        """How many of a step's newest queries the attention statistics cover; None: all of them."""
        return None

    @property
    def drops_blocks(self) -> bool:
        """True: the layer drops the oldest whole codec blocks instead of ranking slots (policies/block_window.py)."""
        return False

    @property
    def evicts(self) -> bool:
        return self.budget is not None or self.ratio is not None

    @property
    def evicts_while_decoding(self) -> bool:
        """False: a decode step (one new token) is neither scored nor evicted, and generated tokens join what the
        prompt steps kept (SnapKV's `decoding="append"`): the steady decode step then costs what a cache of the kept
        tokens costs."""
        return True

    @property
    def appends_question(self) -> bool:
        """True (for a policy that does not evict while decoding): tokens prefilled after a prompt the cache has
        compressed (generation.prefill with compress=False, as generate() feeds a question after its document) join
        what is kept unscored, as decode steps do, instead of being scored and evicted as another chunk of the
        prompt; the cache then holds the prompt's ratio or budget plus the question."""
        return False

    @property
    def ranks_prompt(self) -> bool:
        """True: the cache holds the prompt whole and ranks every layer's pairs once it is read
        (CompressedCache.rank_prompt; KVzap's head budgets)."""
        return False

    def for_layout(self, windowed: bool) -> Policy:
        """This policy with the defaults that depend on the model's layout settled (KVzip's and KVzap's `span`):
        `windowed` is whether the model has sliding-window (or chunked) attention layers. The cache calls it once,
        when it is built (caches/compressed.py), so its layers and its spec hold what was used."""
        return self

    def with_byte_share(self, share: float) -> Policy | None:
        """This policy holding `share` of the uncompressed cache's bytes in place of its plain ratio (KVzip's
        `bytes=`), which is how the plan runs that ratio below a half (caches/plan.py `ratio_as_bytes`); None: the
        policy keeps its ratio and the plan its own rule."""
        return None

    def kept_per_row(self, real_seen: torch.Tensor) -> torch.Tensor:
        """Real tokens each row may keep, [B], from the real tokens it has seen (never fewer than sinks + recent)."""
        if self.budget is not None:
            return torch.full_like(real_seen, self.budget)
        assert self.ratio is not None  # an evicting policy without a budget has a ratio (check_budget_or_ratio)
        floor = torch.clamp(real_seen, max=self.sink_tokens + self.recent)
        share = torch.ceil(real_seen.double() * self.ratio).long()
        return torch.maximum(share, floor)

    def held_per_row(self, real_seen: torch.Tensor) -> torch.Tensor:
        """Real tokens each row holds once evicted, [B]: `kept_per_row`, but never more than it has seen (a budget
        above the tokens seen keeps them all). A global ranking shares this out between layers and heads, and a
        layer's allowance grows with it while later tokens arrive, up to the budget."""
        return torch.minimum(self.kept_per_row(real_seen), real_seen)

    def observe(self, accumulated: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Fold a step's attention statistics [B, H_kv, T] into the running ones (H2O: a running sum)."""
        return accumulated + attention

    def score(
        self,
        accumulated: torch.Tensor | None,
        length: int,
        keys: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        pads: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Per-slot importance [B, H_kv, T]; None means recency (newer is more important).

        `accumulated`: the attention statistics of `observe` (or a reconstruction pass); `keys` [B, H_kv, T, D]
        when `needs_keys`; `positions` [B, H_kv, T] when `needs_positions`; `pads` [B]: leading padding slots.
        Policies that set `needs_values` or `needs_queries` also receive `values=` [B, H_kv, T, D] or `queries=`
        (RecentQueries), as keywords that only they declare.
        """
        return None

    def spec(self) -> str:
        """The spec string that rebuilds this policy (its name and the fields that differ from the defaults)."""
        sliding = f"sliding={self.sliding}" if self.sliding is not None else ""
        return join_spec(self.name, ",".join(filter(None, (changed_fields(self, skip=("sliding",)), sliding))))


@dataclass(frozen=True)
class RecentQueries:
    """The newest queries a layer keeps for a policy that models the next ones (`needs_queries`).

    `queries` [B, H_q, N, D]: before RoPE, scaled as attention scales them (the newest last); `counted` [B, N]: the
    entries that are a row's real queries (not padding, not yet filled, not its first sink tokens);
    `next_position` [B]: the position of each row's next query; `inv_freq` [rotary_dim / 2]: the model's RoPE
    frequencies (empty when it does not rotate).
    """

    queries: torch.Tensor
    counted: torch.Tensor
    next_position: torch.Tensor
    inv_freq: torch.Tensor


def check_budget_or_ratio(policy, default_budget: int, floor: int) -> None:
    """Validate a policy's `budget` / `ratio` fields: exactly one of them (`default_budget` when neither is given)."""
    budget, ratio = policy.budget, policy.ratio
    if budget is not None and ratio is not None:
        raise ValueError(
            f"give either budget (tokens) or ratio (share of the tokens seen), not both: got {budget!r}, {ratio!r}"
        )
    if ratio is not None:
        check_share("ratio", ratio)
        return
    if budget is None:
        object.__setattr__(policy, "budget", default_budget)
        budget = default_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0 or budget < floor:
        raise ValueError(f"budget must be a positive integer >= recent + sink_tokens ({floor}), got {budget!r}")


def check_kept_tokens(policy, default_budget: int = 512) -> None:
    """Validate the fields every scored policy shares: `recent`, `sink_tokens`, then `budget` / `ratio`."""
    check_count("recent", policy.recent)
    check_count("sink_tokens", policy.sink_tokens)
    check_budget_or_ratio(policy, default_budget, policy.recent + policy.sink_tokens)


def check_share(name: str, value) -> None:
    """Refuse a share (`ratio`, KVzip's `bytes`) that is not a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


# What the tokens after the prompt (questions, answers) cost a policy that takes `decoding`: "append" keeps them beside
# what the prompt's scoring kept (nothing is evicted while decoding), "evict" scores them and evicts to the budget.
DECODING = ("append", "evict")


def check_decoding(value, allow_none: bool = False) -> None:
    """Refuse a `decoding` that is not one of DECODING (None allowed where the policy resolves a default)."""
    if value is None and allow_none:
        return
    if value not in DECODING:
        raise ValueError(f"decoding must be one of {', '.join(DECODING)}, got {value!r}")


def check_floors(value) -> None:
    """Refuse a `floors` (KVzip's and KVzap's per-layer floors, caches/plan.py `layer_floors`) that is neither None,
    "none" nor a path."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"floors must be 'none' or a path to a layer-floors file or directory, got {value!r}")


# The `span` (KVzip's and KVzap's) that `span=None` settles to on a model with sliding-window layers; 0 without them
# (`resolve_span`). On Gemma-3-270M's development half span 0 lost 2 of 5 middle answers at a quarter that span 4 kept
# (when the question evicted pairs); on SmolLM2 (no sliding layers) span 0 kept every answer at every share where
# span 4 lost the middle of the document at an eighth (docs/results.md, "span by layout").
WINDOWED_SPAN = 4


def resolve_span(span: int | None, windowed: bool) -> int:
    """`span`, or its default by the model's layout: WINDOWED_SPAN with sliding-window layers, else 0."""
    if span is not None:
        return span
    return WINDOWED_SPAN if windowed else 0


def check_count(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def select_kept(
    policy: Policy,
    scores: torch.Tensor | None,
    pads: torch.Tensor,
    heads: int,
    length: int,
    keep: torch.Tensor | None = None,
    most: int | None = None,
) -> torch.Tensor:
    """Slots to keep, [B, H_kv, K], ascending, per row and head.

    Row b keeps its `keep[b]` best real slots (default: the policy's fixed budget) and fills the rest of the K
    slots (K = the largest row's allowance) with padding. Padding slots (the first `pads[b]` of row b) go first and
    are never protected, so a row keeps padding only when it keeps fewer real tokens than K; its sinks are its first
    real tokens. Keeping the surviving padding at the front is what keeps transformers' 2-D padding mask aligned
    with the kept slots. `most` is `keep.max()` when the caller knows it (saves a host read of a device value).
    """
    batch = pads.shape[0]
    device = pads.device
    if keep is None:
        assert policy.budget is not None  # callers give `keep` unless the budget is fixed
        keep = torch.full((batch,), policy.budget, dtype=torch.long, device=device)
    total = int(keep.max()) if most is None else most
    keep = torch.minimum(keep, length - pads)  # real slots kept per row
    slot = torch.arange(length, device=device)
    is_pad = slot[None, :] < pads[:, None]  # [B, T]
    priority = slot_priority(policy, scores, pads, heads, length)
    chosen = ranked_first(priority, keep[:, None, None]) & ~is_pad[:, None, :]
    # Chosen real slots first, then padding to fill each row up to `total` slots, never unchosen real slots.
    level = chosen.to(torch.float32) * 2 + is_pad[:, None, :].to(torch.float32)
    kept = torch.topk(level, total, dim=-1, sorted=False).indices
    # A row that must drop real tokens while another row keeps all its slots (a ratio held at its sinks + recent
    # floor) may have too little padding left to fill up to `total`: its filler then points at slot 0, so every
    # filler sorts before the chosen slots, where the row's padding is counted (and masked), never between them.
    filler = ~(chosen | is_pad[:, None, :]).gather(-1, kept)
    kept = kept.masked_fill(filler, 0)
    return kept.sort(dim=-1).values


def ranked_first(priority: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Bool mask of the `counts` highest priorities along the last dim (ties: the first slot first)."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    slot = torch.arange(priority.shape[-1], device=priority.device)
    rank = torch.empty_like(order).scatter_(-1, order, slot.expand_as(order))
    return rank < counts


def slot_priority(
    policy: Policy, scores: torch.Tensor | None, pads: torch.Tensor, heads: int, length: int
) -> torch.Tensor:
    """[B, H_kv, T] float32: the score (recency: the slot), +inf for protected real slots, -inf for padding."""
    batch = pads.shape[0]
    slot = torch.arange(length, device=pads.device)
    is_pad = slot[None, :] < pads[:, None]  # [B, T]
    if scores is None:
        priority = slot.to(torch.float32)[None, None, :].expand(batch, heads, length)
    else:
        priority = scores.to(torch.float32).expand(batch, heads, length)
    protected = (slot[None, :] < pads[:, None] + policy.sink_tokens) | (slot[None, :] >= length - policy.recent)
    protected = protected & ~is_pad
    priority = priority.masked_fill(protected[:, None, :], float("inf"))
    return priority.masked_fill(is_pad[:, None, :], float("-inf"))


def drop_one(policy: Policy, scores: torch.Tensor | None, pads: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    """`select_kept` for the commonest eviction, one slot over a fixed budget (a decode step): [B, H_kv, T - 1].

    Each row and head drops its lowest-priority slot (a padding slot while it has one, else the newest of the
    lowest-scored real slots, as select_kept's stable sort does), found by one argmin instead of a sort and a top-k.
    """
    if scores is None:
        drop = recency_drop(policy, pads, length)[:, None].expand(pads.shape[0], heads)
    else:
        priority = slot_priority(policy, scores, pads, heads, length)
        drop = (length - 1) - priority.flip(-1).argmin(-1)  # argmin returns the first minimum: flipped, the newest
    slot = torch.arange(length - 1, device=pads.device)
    return slot + (slot >= drop[..., None]).long()


def recency_drop(policy: Policy, pads: torch.Tensor, length: int) -> torch.Tensor:
    """[B]: the slot `drop_one` drops by recency (no scores), found from each row's padding alone, without
    `slot_priority` over every slot: the newest padding slot while a row has padding (priority -inf), else its
    oldest unprotected real slot (the lowest slot number), else, every slot protected (+inf), the newest one."""
    oldest = pads + policy.sink_tokens  # the first real slot after the row's sinks
    unprotected = torch.where(oldest < length - policy.recent, oldest, length - 1)
    return torch.where(pads > 0, pads - 1, unprotected)
