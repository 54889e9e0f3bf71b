"""How a layer learns the scores its policy ranks slots by: a scorer, chosen once from the policy's flags, that owns
what it keeps to score with.

`CompressedLayer.update` runs the same pipeline for every policy and asks its scorer at fixed points: before the
step's tokens are stored (`check_step`), after (`begin_step`: True when eviction waits for attention), when
attention delivers what was asked (`observe`: True when the layer evicts now) and when it scores the slots
(`score_inputs`: what the scorer hands `policy.score` besides the stored state). A policy that scores by attention
statistics (H2O, SnapKV, TOVA) or by the newest queries (Expected Attention) asks our attention function for them
through the attention kwargs (requests.py), and the layer evicts when they arrive; KVzip's scores come from a
reconstruction pass (below); the other policies read only what is stored.

Every layer of a cache takes part in KVzip's reconstruction pass (`reconstruction_queries` set: it attends over
what it keeps plus the step's tokens and keeps nothing new); only `ReconstructionScores` asks attention for the most
each kept slot receives, and evicts by it at the pass's end.

A scorer's own tensors move with the layer's rows (`select_rows`), are cut by `crop`, counted by `nbytes` and saved
and loaded by `state` / `load_state`, under the names they had on the layer (saved caches keep loading). Methods
that take `layer` take the CompressedLayer that owns the scorer; the scorer keeps no reference to it.
"""

from __future__ import annotations

import torch

from ..ops.rerotate import rerotate
from ..policies.base import Policy
from ..policies.base import RecentQueries as QueryWindow
from ..probes import estimated_score
from .requests import ENABLE_ATTENTION_HINT, HIDDEN_KEY, HIDDEN_STATES_HINT, OBSERVER_KEY, AttentionRequest

# Scores of tokens that arrive after a reconstruction pass start here: above any attention probability, newest first.
AFTER_RECONSTRUCTION = 2.0


def grow_accumulated(layer, new: int, fill_from: float | None = None) -> None:
    """Give the `new` slots just stored their entries in `slots.accumulated`: 0, or `fill_from` counting up."""
    fresh = torch.zeros(layer.batch_size, layer.kv_heads, new, device=layer.device, dtype=torch.float32)
    if fill_from is not None:
        fresh += fill_from + torch.arange(new, device=layer.device, dtype=torch.float32)
    layer.slots.append("accumulated", fresh)


class Scorer:
    """What every scorer does: by default nothing (everything `policy.score` reads is stored already), the requests
    to attention, and the part of the reconstruction pass every layer takes.

    `awaiting_attention`: a request is out, and attention must deliver before the next step; `reconstruction_queries`
    [B, q] bool: the queries of the reconstruction step that count (padding inside a chunk does not), set while a
    pass runs.
    """

    scored = False  # a reconstruction pass has scored the kept slots (set by ReconstructionScores only)

    def __init__(self):
        self.awaiting_attention = False
        self.reconstruction_queries: torch.Tensor | None = None

    # -- a step --------------------------------------------------------------------------------------------------

    def check_step(self, layer, new: int) -> None:
        """Refuse a step of `new` tokens before anything is stored."""

    def begin_step(self, layer, attn_kwargs: dict | None, new: int) -> bool:
        """Do this scorer's part of a step of `new` tokens, once they are stored; True: eviction waits for
        attention to deliver (`observe`)."""
        return False

    def later_scores(self, layer, attn_kwargs: dict | None, new: int) -> torch.Tensor | None:
        """[B, H_kv, new] scores of a step's tokens once the layer keeps a head store (after the ranking), comparable
        with the ranked pairs' scores; None: they rank above the ranked pairs, newest first (head_store.py)."""
        return None

    def observe(self, layer, delivered: torch.Tensor) -> bool:
        """Receive what attention delivered for this scorer's request; True: the layer evicts and encodes now."""
        raise RuntimeError(f"{type(self).__name__} asks attention for nothing")

    @property
    def has_scores(self) -> bool:
        """Whether `policy.score` can rank the slots now (KVzip's only once its pass has run)."""
        return True

    def score_inputs(self, layer) -> dict:
        """The keywords this scorer hands `policy.score` besides the stored state (keys, positions, pads)."""
        return {}

    def after_compress(self, layer) -> None:
        """The layer has evicted (when due) and encoded after what attention delivered this step."""

    def request(self, layer, attn_kwargs: dict | None, request: AttentionRequest) -> None:
        """Ask the attention function, through the attention kwargs, for what `request` names."""
        if attn_kwargs is None:
            raise RuntimeError(
                f"{type(layer.policy).__name__} needs the attention kwargs that transformers passes to cache "
                "layers; this model does not pass them"
            )
        attn_kwargs[OBSERVER_KEY] = request
        self.awaiting_attention = True

    # -- the reconstruction pass (KVzip; generation.prefill drives it through CompressedCache) ---------------------

    def begin_reconstruction(self, layer) -> None:
        """A pass begins over the initialized `layer`."""

    def reconstruction_step(self, layer, attn_kwargs: dict | None) -> None:
        """A step of the pass: the layer attends over what it keeps plus the step's tokens and keeps nothing new."""

    def check_attention_served(self, layer) -> None:
        """Refuse a reconstruction step whose attention statistics never arrived (the model runs another attention
        function): the pass would end with every score 0 and evict arbitrary slots."""
        if self.reconstruction_queries is not None and self.awaiting_attention:
            self.awaiting_attention = False
            raise RuntimeError(f"{type(layer.policy).__name__} scores tokens by attention: {ENABLE_ATTENTION_HINT}")

    def end_reconstruction(self, layer, evict: bool) -> bool:
        """The pass ends (`evict=False`: it failed); True: the layer evicts now, by the pass's scores."""
        self.reconstruction_queries = None
        self.awaiting_attention = False
        return False

    # -- its own state --------------------------------------------------------------------------------------------

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` [B'] (long), in that order (beam search, batch selection)."""

    def crop(self, keep: int, seen: int) -> None:
        """Of the `seen` tokens, only the `keep` oldest remain (crop)."""

    def nbytes(self) -> int:
        """Bytes this scorer's tensors hold (between steps)."""
        return 0

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Its tensors and numbers by name, as a saved cache stores them."""
        return {}, {"scored": self.scored}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> None:
        """Restore what `state` returned (other names are ignored), on `device`."""


class NoScores(Scorer):
    """Recency, keys, values or positions: everything `policy.score` reads is stored already."""


class AttentionStatistics(Scorer):
    """`policy.needs_attention`: each new slot starts at 0 in `slots.accumulated` (a per-slot record, moved with
    the slots); attention delivers the step's statistics [B, H_kv, kv], which `policy.observe` folds in."""

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        grow_accumulated(layer, new)
        if layer.eviction.appends(new):  # a decode step that evicts nothing: no statistics to wait for
            return False
        policy = layer.policy
        request = AttentionRequest(layer.observe, policy.observed_queries, policy.attention_reduction)
        self.request(layer, attn_kwargs, request)
        return True

    def observe(self, layer, delivered) -> bool:
        accumulated = layer.slots.accumulated
        layer.slots.accumulated = layer.policy.observe(accumulated, delivered.to(accumulated.dtype))
        self.awaiting_attention = False
        return True


class RecentQueries(Scorer):
    """`policy.needs_queries` (Expected Attention): the newest queries, which model the next ones.

    A step's queries exist only inside attention: the scorer asks our attention function for the step's newest ones
    (`policy.observed_queries`, None: all of them) and turns them back to before RoPE with the model's frequencies
    (the policy turns them to the positions ahead itself). A policy that `evicts_while_decoding` (`decoding="evict"`)
    keeps the last `observed_queries` per row between steps, since each decode step is scored by them; otherwise the
    queries serve their own step's eviction and are dropped when it is done (`after_compress`), so the cache holds
    nothing beside its kept pairs, and a decode step that evicts nothing asks for none. Padding queries are kept in
    place and left out when scored, so a padded row's window holds the same counted queries as the row alone.

    `recent_queries` [B, H_q, L, D]: the pre-RoPE queries of each row's newest L tokens (zeros where a row has had
    fewer), between steps only when held; `next_position` [B]: the position of each row's next query;
    `query_positions` [B, n]: the positions of the queries awaited from attention, during a step.
    """

    def __init__(self, policy: Policy, inv_freq: tuple[float, ...] | None):
        """`inv_freq`: the RoPE frequencies the queries are turned back with (empty: the model does not rotate them);
        numbers, not a tensor: a configuration, not cache storage (measured_kv_bytes counts every tensor it finds)."""
        super().__init__()
        if inv_freq is None:
            raise ValueError(f"{policy.name} keeps queries before RoPE: give the layer the model's RoPE frequencies")
        self.inv_freq = inv_freq
        self.recent_queries: torch.Tensor | None = None
        self.next_position: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        """Ask attention for this step's newest queries; remember their positions to undo their rotation."""
        policy = layer.policy
        if layer.eviction.appends(new):  # a decode step that evicts nothing: no queries held between steps either
            return False
        newest = new if policy.observed_queries is None else min(new, policy.observed_queries)
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != new:
            start = layer.seen - new
            position_ids = torch.arange(start, start + new, device=layer.device)[None, :]
        self.query_positions = (
            position_ids[:, new - newest :].to(layer.device, torch.long).expand(layer.batch_size, newest)
        )
        self.request(layer, attn_kwargs, AttentionRequest(layer.observe, newest, queries=True))
        return True

    def observe(self, layer, delivered) -> bool:
        """Keep the step's newest queries [B, H_q, n, D] (rotated and scaled)."""
        queries = delivered
        batch, heads, newest, dim = queries.shape
        assert self.query_positions is not None  # set by `begin_step`, which asked for these queries
        if self.inv_freq:
            back = -self.query_positions[:, None, :].expand(batch, heads, newest)
            queries = rerotate(queries, back, torch.tensor(self.inv_freq, dtype=torch.float32))
        if layer.policy.evicts_while_decoding:
            window = layer.policy.observed_queries
            if self.recent_queries is None:
                self.recent_queries = torch.zeros(batch, heads, window, dim, dtype=layer.dtype, device=layer.device)
            held = self.recent_queries.shape[2]
            older = self.recent_queries[:, :, held - min(held, window - newest) :]
            self.recent_queries = torch.cat([older, queries.to(layer.dtype)], dim=2)
        else:  # this step's queries alone, for this step's eviction (float32, as delivered: they are not stored)
            self.recent_queries = queries
        self.next_position = self.query_positions[:, -1] + 1
        self.query_positions = None
        self.awaiting_attention = False
        return True

    def score_inputs(self, layer) -> dict:
        return {"queries": self.window(layer)}

    def after_compress(self, layer) -> None:
        """A step's eviction is done: queries that are not held between steps go."""
        if not layer.policy.evicts_while_decoding:
            self.recent_queries = None

    def window(self, layer) -> QueryWindow:
        """The window as the policy reads it: entry e of L is the row's token seen - L + e, counted when it is
        real and past the row's sink tokens (padding comes first in a row; entries a row never filled lie before)."""
        # Read for an eviction, which follows the queries' arrival (`observe` sets both).
        assert self.recent_queries is not None and self.next_position is not None
        held = self.recent_queries.shape[2]
        entry = torch.arange(held, device=layer.device)
        counted = entry[None, :] >= (held - layer.padding.real_seen + layer.policy.sink_tokens)[:, None]
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32, device=layer.device)
        return QueryWindow(self.recent_queries, counted, self.next_position, inv_freq)

    def select_rows(self, indices) -> None:
        if self.recent_queries is not None:
            assert self.next_position is not None  # set with `recent_queries`
            self.recent_queries = self.recent_queries.index_select(0, indices)
            self.next_position = self.next_position.index_select(0, indices)

    def crop(self, keep, seen) -> None:
        """Forget the queries of the newest tokens that go: the window holds fewer until refilled."""
        if self.recent_queries is None:
            return
        removed = seen - keep
        held = self.recent_queries.shape[2]
        self.recent_queries = self.recent_queries[:, :, : held - min(removed, held)].clone(
            memory_format=torch.contiguous_format
        )
        self.next_position = self.next_position - removed

    def _held(self) -> dict[str, torch.Tensor]:
        return {
            name: tensor
            for name, tensor in (("recent_queries", self.recent_queries), ("next_position", self.next_position))
            if tensor is not None
        }

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held().values())

    def state(self):
        tensors, meta = super().state()
        return {**tensors, **self._held()}, meta

    def load_state(self, tensors, meta, device) -> None:
        for name in ("recent_queries", "next_position"):
            if name in tensors:
                setattr(self, name, tensors[name].to(device, copy=True))


class ReconstructionScores(Scorer):
    """`policy.scores_by_reconstruction` (KVzip): after the prompt, the model reads it again, and the most
    attention each kept slot receives from the pass's queries becomes its score in `slots.accumulated`.

    The cache cannot call the model itself: generation.prefill feeds the repeated prompt between
    `begin_reconstruction` and `end_reconstruction` (through CompressedCache), and the pass's end evicts by those
    scores (`scored` from then on). Tokens after the pass rank above the context, newest first.
    """

    @property
    def has_scores(self) -> bool:
        return self.scored

    def check_step(self, layer, new) -> None:
        """Refuse to decode past the budget before the pass has run (model.generate alone)."""
        if not self.scored and new == 1 and layer.over_budget():
            raise RuntimeError(
                f"{type(layer.policy).__name__} compresses a prompt after reading it again: prefill it with "
                "hf_kvcompress.prefill(model, input_ids, attention_mask, cache, repeat_prompt_ids=...) (or "
                "hf_kvcompress.generation.generate), not with model.generate alone"
            )

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        if self.scored:
            grow_accumulated(layer, new, fill_from=AFTER_RECONSTRUCTION + layer.seen)
        return False

    def observe(self, layer, delivered) -> bool:
        """Take the most attention [B, H_kv, kv] each kept slot received in a step of the pass; evict at its end."""
        stored = layer.slots.accumulated.shape[-1]
        layer.slots.accumulated = torch.maximum(layer.slots.accumulated, delivered[..., :stored].to(torch.float32))
        self.awaiting_attention = False
        return False

    def begin_reconstruction(self, layer) -> None:
        layer.slots.accumulated = torch.zeros(
            layer.batch_size, layer.kv_heads, layer.stored_tokens, device=layer.device, dtype=torch.float32
        )

    def reconstruction_step(self, layer, attn_kwargs) -> None:
        self.request(layer, attn_kwargs, AttentionRequest(layer.observe, None, "max", self.reconstruction_queries))

    def end_reconstruction(self, layer, evict) -> bool:
        super().end_reconstruction(layer, evict)
        if not evict:  # keep every slot unscored: decoding past the budget refuses as if the pass never ran
            layer.slots.accumulated = None
            return False
        if layer.is_initialized:
            self.scored = True
            return True
        return False

    def load_state(self, tensors, meta, device) -> None:
        self.scored = bool(int(meta["scored"]))


class ProbeScores(Scorer):
    """`policy.needs_hidden_states` (KVzap): each new slot's score in `slots.accumulated` is the layer's probe
    applied to the hidden state entering attention (as `probes.estimated_score`), which the hook on the attention
    module hands over in the attention kwargs (hf/hidden_states.py). A token is scored once, when it arrives, by
    what it is: the same scores at prefill, in chunks or at once, and at decode. With `policy.ranks_prompt` (head
    budgets) nothing is evicted until the cache ranks every layer's pairs (CompressedCache.rank_prompt, which makes
    the layer a head store and sets `scored`), and the tokens after it are scored the same way into the head store
    (`later_scores`); otherwise eviction follows in the same step.

    `probe`: the layer's probe (probes.py), [B, n, hidden] -> [B, H_kv, n]; model weights shared by every cache of
    the model, not this cache's storage (nbytes counts none of it).
    """

    def __init__(self, policy: Policy, probe):
        super().__init__()
        if probe is None:
            raise ValueError(
                f"{policy.name} scores tokens with a per-model probe: build the cache with the model's config "
                "(make_cache(spec, model.config)), on a model with a probe (hf-kvcompress calibrate --probe)"
            )
        self.probe = probe
        self.waits_for_ranking = policy.ranks_prompt

    @property
    def has_scores(self) -> bool:
        return self.scored or not self.waits_for_ranking

    def begin_step(self, layer, attn_kwargs, new) -> bool:
        layer.slots.append("accumulated", self._estimates(layer, attn_kwargs, new))
        return False

    def later_scores(self, layer, attn_kwargs, new) -> torch.Tensor:
        """After the ranking a token is scored as before it: by the probe, so it competes with the ranked pairs."""
        return self._estimates(layer, attn_kwargs, new)

    def _estimates(self, layer, attn_kwargs, new) -> torch.Tensor:
        """[B, H_kv, new]: the probe's estimates of the step's tokens from the hidden states attention was handed."""
        hidden = None if attn_kwargs is None else attn_kwargs.get(HIDDEN_KEY)
        if hidden is None:
            raise RuntimeError(
                f"{type(layer.policy).__name__} scores tokens from their hidden states: {HIDDEN_STATES_HINT}"
            )
        if hidden.shape[:2] != (layer.batch_size, new):
            raise RuntimeError(
                f"the hidden state handed to this layer is for {tuple(hidden.shape[:2])} (rows, tokens), the step "
                f"stores ({layer.batch_size}, {new})"
            )
        return estimated_score(self.probe(hidden))


def scorer_for(policy: Policy, query_inv_freq: tuple[float, ...] | None = None, probe=None) -> Scorer:
    """The scorer a layer with `policy` uses (the queries first: Expected Attention sets both attention flags);
    `query_inv_freq`: the model's RoPE frequencies, for a policy that keeps queries; `probe`: the layer's score
    probe, for a policy that scores from hidden states."""
    if policy.needs_hidden_states:
        return ProbeScores(policy, probe)
    if policy.needs_queries:
        return RecentQueries(policy, query_inv_freq)
    if policy.needs_attention:
        return AttentionStatistics()
    if policy.scores_by_reconstruction:
        return ReconstructionScores()
    return NoScores()
