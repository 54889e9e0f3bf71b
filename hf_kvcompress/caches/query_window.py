"""The newest queries a layer keeps for a policy that models the next queries (Expected Attention).

A step's queries exist only inside attention: the layer asks our attention function for the step's newest ones
(requests.py), turns them back to before RoPE with the model's frequencies (the policy turns them to the positions
ahead itself) and keeps the last `window` per row. Padding queries are kept in place and left out when scored, so
a padded row's window holds the same counted queries as the row alone.
"""

from __future__ import annotations

import torch

from ..ops.rerotate import rerotate
from ..policies.base import RecentQueries
from .requests import AttentionRequest


class QueryWindow:
    """CompressedLayer's query window (a mixin): `recent_queries` [B, H_q, L, D], the pre-RoPE queries of the
    row's newest L <= window tokens (zeros where a row has had fewer), and `next_position` [B]."""

    def _request_queries(self, attn_kwargs: dict | None, new: int) -> None:
        """Ask attention for this step's newest queries; remember their positions to undo their rotation."""
        newest = min(new, self.policy.observed_queries)
        position_ids = None if attn_kwargs is None else attn_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != new:
            start = self.seen - new
            position_ids = torch.arange(start, start + new, device=self.device)[None, :]
        self.query_positions = position_ids[:, new - newest :].to(self.device, torch.long).expand(self.batch_size, newest)
        self._request_attention(attn_kwargs, AttentionRequest(self.observe_queries, newest, queries=True))

    def observe_queries(self, queries: torch.Tensor) -> None:
        """Receive the step's newest queries [B, H_q, n, D] (rotated and scaled), keep them, then evict and encode."""
        batch, heads, newest, dim = queries.shape
        if self.query_inv_freq:
            back = -self.query_positions[:, None, :].expand(batch, heads, newest)
            queries = rerotate(queries, back, torch.tensor(self.query_inv_freq, dtype=torch.float32))
        window = self.policy.observed_queries
        if self.recent_queries is None:
            self.recent_queries = torch.zeros(batch, heads, window, dim, dtype=self.dtype, device=self.device)
        held = self.recent_queries.shape[2]
        older = self.recent_queries[:, :, held - min(held, window - newest) :]
        self.recent_queries = torch.cat([older, queries.to(self.dtype)], dim=2)
        self.next_position = self.query_positions[:, -1] + 1
        self.query_positions = None
        self.awaiting_attention = False
        self._compress()

    def _recent_queries(self) -> RecentQueries:
        """The window as the policy reads it: entry e of L is the row's token seen - L + e, counted when it is
        real and past the row's sink tokens (padding comes first in a row; entries a row never filled lie before)."""
        held = self.recent_queries.shape[2]
        entry = torch.arange(held, device=self.device)
        counted = entry[None, :] >= (held - self.padding.real_seen + self.policy.sink_tokens)[:, None]
        inv_freq = torch.tensor(self.query_inv_freq, dtype=torch.float32, device=self.device)
        return RecentQueries(self.recent_queries, counted, self.next_position, inv_freq)

    def _crop_queries(self, removed: int) -> None:
        """Forget the queries of the `removed` newest tokens (crop): the window holds fewer until refilled."""
        if self.recent_queries is None:
            return
        held = self.recent_queries.shape[2]
        self.recent_queries = self.recent_queries[:, :, : held - min(removed, held)].clone(
            memory_format=torch.contiguous_format
        )
        self.next_position = self.next_position - removed
