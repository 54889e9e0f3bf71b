"""Expected Attention: keep what the next queries are expected to attend to (arXiv:2510.00636)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import Policy, RecentQueries, check_count, check_decoding, check_kept_tokens

# The newest queries `decoding="evict"` holds between steps when `window` is None (each of its decode steps scores by
# them; a single step's query alone would model the next ones by one sample).
HELD_WINDOW = 64


@dataclass(frozen=True)
class ExpectedAttentionPolicy(Policy):
    """Score each slot by the attention that future queries, modelled as a Gaussian, are expected to give it.

    Before RoPE a head's queries are close to Gaussian (Expected Attention, Sec. 3), so the mean and covariance
    of the `window` newest ones stand for the next ones. Each position ahead turns a query by its own RoPE angle:
    the rotation is averaged over the `future` next positions (it is linear, so rotating the queries first and then
    taking their statistics is the same as rotating the statistics). For a key k and q ~ N(mu, Sigma), in closed
    form, E[exp(q.k)] = exp(mu.k + k^T Sigma k / 2) (q scaled as attention scales it); these are normalised over the
    row's keys past its sinks (a softmax), averaged over the query heads of the KV group and, since what a pair adds
    to the output also scales with its value, weighted as (p + epsilon) * ||v||. No attention is recomputed and no
    second pass runs; each eviction costs one D x D quadratic form per key and query head.

    By default (`decoding="append"`, as kvpress's ExpectedAttentionPress and SnapKV) a step of several tokens (the
    prompt, a chunk of it) is scored by the statistics of its own queries and evicted to the budget or ratio; a
    decode step is neither scored nor evicted, and neither is a question prefilled after the compressed document
    (`appends_question`): kvpress's pipeline compresses the context alone and appends the question whole, so the
    cache holds R of the document plus the question. The queries live only for their step, so the cache holds the
    kept pairs and nothing else: `ratio=R` holds R of the uncompressed cache's bytes (the 64 queries held between
    steps before made `ratio=0.5` hold 0.598 of SmolLM2's bf16 bytes, docs/results.md). A prompt read at once is
    thus scored by every query of the document, as kvpress scores it.

    Args:
        budget: tokens kept per KV head (512 when neither budget nor ratio is given).
        ratio: share of the tokens seen that is kept, instead of `budget`.
        window: the newest queries whose statistics model the future ones; None: every query of the step (past the
            row's first `sink_tokens`) with `decoding="append"`, and the newest 64 with `decoding="evict"`, which
            holds them between steps (per row, query head and layer: window x D values each, counted in the cache's
            bytes and beside its budget or ratio).
        future: positions ahead over which the queries' RoPE rotation is averaged (512 in kvpress).
        covariance: add the covariance term k^T Sigma k / 2; false scores by the mean query alone.
        value_norm: weight each pair by the norm of its value.
        epsilon: added to the normalised expectation before the value weighting. The expectations average 1 / T
            over T kept slots, so 0.01 (kvpress's leaderboard setting; its class default is 0) ranks most slots
            by value norm and lifts those the future queries are expected to attend to well above average; 0
            ranks by expected attention alone, which on the needle documents keeps mostly the end (docs/results.md).
        recent: newest tokens always kept.
        sink_tokens: first tokens always kept; their queries are also left out of the statistics (outliers, as
            the attention sinks' queries are), and their keys out of the normalisation.
        decoding: "append" (a decode step, and a question prefilled after the compressed document, join what is
            kept, unscored: the cache grows by their tokens beyond what the document was compressed to) or "evict"
            (every later step, the question's included, is scored, a decode step by the held window, and evicted
            back to the budget or ratio of the tokens seen).
    """

    name: ClassVar[str] = "expected_attention"

    budget: int | None = None
    ratio: float | None = None
    window: int | None = None
    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.01
    recent: int = 0
    sink_tokens: int = 4
    decoding: Literal["append", "evict"] = "append"
    needs_attention: ClassVar[bool] = True  # the queries come through our attention function
    needs_queries: ClassVar[bool] = True
    needs_keys: ClassVar[bool] = True

    def __post_init__(self):
        if self.window is not None:
            check_count("window", self.window, minimum=1)
        check_decoding(self.decoding)
        check_count("future", self.future, minimum=1)
        for flag in ("covariance", "value_norm"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"epsilon must be a finite number >= 0, got {eps!r}")
        check_kept_tokens(self)

    @property
    def observed_queries(self) -> int | None:
        """The newest queries of a step the statistics take (None: all of them); `decoding="evict"` holds them
        between steps, so it needs a number."""
        if self.window is None and self.evicts_while_decoding:
            return HELD_WINDOW
        return self.window

    @property
    def evicts_while_decoding(self) -> bool:
        """Each decode step is scored, by the newest queries held between steps (caches/scorers.RecentQueries)."""
        return self.decoding == "evict"

    @property
    def appends_question(self) -> bool:
        """With `decoding="append"` a question prefilled after the document is appended unscored, as kvpress's
        pipeline appends it (scored as a step of its own, the statistics of its few queries would evict pairs of
        the document and of the question itself down to the ratio of both)."""
        return self.decoding == "append"

    @property
    def needs_values(self) -> bool:  # type: ignore[override]  # the base's class flag; here the `value_norm` field
        return self.value_norm

    def score(self, accumulated, length, keys=None, positions=None, pads=None, values=None, queries=None):
        mean, cov = self.future_query_statistics(queries)  # [B, H_q, D], [B, H_q, D, D]
        batch, kv_heads, slots, dim = keys.shape
        groups = mean.shape[1] // kv_heads
        k = keys.float()
        mean = mean.view(batch, kv_heads, groups, dim)
        logits = torch.einsum("bhgd,bhtd->bhgt", mean, k)  # [B, H_kv, g, T]
        if self.covariance:
            spread = torch.matmul(k[:, :, None], cov.view(batch, kv_heads, groups, dim, dim))  # [B, H_kv, g, T, D]
            logits = logits + (spread * k[:, :, None]).sum(-1) / 2
        # Padding and the row's sink tokens (kept whatever they score) take no share of the normalisation, as
        # ExpectedAttentionPress scores the keys after its sinks: a padded row ranks as it would alone, and the mass
        # a head puts on its sinks does not shrink its say in the KV group's mean (or its scores beside epsilon).
        first = (pads if pads is not None else torch.zeros(batch, dtype=torch.long, device=k.device)) + self.sink_tokens
        left_out = torch.arange(slots, device=k.device)[None, :] < first[:, None]  # [B, T]
        logits = logits.masked_fill(left_out[:, None, None, :], float("-inf"))
        expected = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)  # [B, H_kv, T]
        if self.value_norm:
            expected = (expected + self.epsilon) * values.float().norm(dim=-1)
        return expected

    def future_query_statistics(self, queries: RecentQueries) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean [B, H_q, D] and covariance [B, H_q, D, D] of the counted queries, turned by the RoPE rotation
        averaged over each row's `future` next positions."""
        turned = average_rotation(queries.queries.float(), queries.next_position, queries.inv_freq, self.future)
        counted = queries.counted[:, None, :, None]  # [B, 1, N, 1]
        number = queries.counted.sum(-1).clamp(min=1).to(turned.dtype)[:, None, None]  # [B, 1, 1]
        turned = torch.where(counted, turned, 0.0)
        mean = turned.sum(dim=2) / number
        centered = torch.where(counted, turned - mean[:, :, None], 0.0)
        cov = torch.matmul(centered.transpose(-1, -2), centered) / number[..., None]
        return mean, cov


def average_rotation(x: torch.Tensor, next_position: torch.Tensor, inv_freq: torch.Tensor, future: int) -> torch.Tensor:
    """x [B, H, N, D] turned by the mean of the RoPE rotations of positions next_position[b] ... + future - 1.

    The mean of rotations by angles a is the map x -> x * mean(cos a) + rotate_half(x) * mean(sin a) (rotate-half
    RoPE, as in Llama-family models); channels beyond 2 * len(inv_freq) (partial rotary) are not turned.
    """
    half = inv_freq.shape[0]
    if half == 0:  # the model does not rotate its queries (GPT-2's learned positions)
        return x
    ahead = next_position.to(x.device)[:, None] + torch.arange(future, device=x.device)  # [B, F]
    angles = ahead.to(torch.float32)[..., None] * inv_freq.to(x.device, torch.float32)  # [B, F, D_rot / 2]
    cos = angles.cos().mean(dim=1).repeat(1, 2)[:, None, None, :]  # [B, 1, 1, D_rot]
    sin = angles.sin().mean(dim=1).repeat(1, 2)[:, None, None, :]
    rot = 2 * half
    rotating = x[..., :rot]
    rotated_half = torch.cat([-rotating[..., half:], rotating[..., :half]], dim=-1)
    turned = rotating * cos + rotated_half * sin
    return torch.cat([turned, x[..., rot:]], dim=-1) if rot < x.shape[-1] else turned
