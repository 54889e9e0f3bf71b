"""Share one key and one value across groups of KV heads after training: GQA/MQA applied to a trained cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..hf.compat import text_config
from .base import Kind
from .reducing import ReducingCodec


def kv_head_count(config) -> int:
    decoder = text_config(config)
    return getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads


@dataclass(frozen=True)
class SharedHeadsCodec(ReducingCodec):
    """Stores the mean key and the mean value of each group of `heads_per_group` adjacent KV heads.

    The lesson's head-sharing family (GQA, arXiv:2305.13245) is trained in; this codec shows what it costs on a
    checkpoint that was not: each group's heads read the group's mean. The mean is the representative that
    minimises the squared error of the group's heads, token by token. Evicting policies keep one selection per
    group (scores averaged over the group), since the group stores one set of tokens.

    Args:
        heads_per_group: KV heads sharing one stored head; None shares all of a layer's KV heads (MQA).
            Must divide the model's KV-head count; a model with a single KV head has nothing left to share.
        storage: how the shared heads are stored (full precision by default; `shared_heads+int8` quantizes them).
    """

    name: ClassVar[str] = "shared_heads"

    heads_per_group: int | None = None

    def __post_init__(self):
        if self.heads_per_group is not None and (not isinstance(self.heads_per_group, int) or self.heads_per_group < 2):
            raise ValueError(
                f"heads_per_group must be an integer >= 2 or None (all KV heads), got {self.heads_per_group!r}"
            )

    @property
    def heads_per_store(self) -> int:  # type: ignore[override]
        return self.heads_per_group or 1

    def reduction_for_model(self, config) -> SharedHeadsCodec:
        """Settle the group for this model's KV heads; refuse models with one KV head or groups that do not divide."""
        heads = kv_head_count(config)
        self.check_kv_heads(heads)
        return self if self.heads_per_group is not None else replace(self, heads_per_group=heads)

    def check_kv_heads(self, heads: int) -> None:
        if heads == 1:
            raise ValueError(
                "shared_heads does not apply to this model: it has a single KV head (multi-query attention), "
                "so its query heads already share one key and one value"
            )
        if self.heads_per_group is not None and heads % self.heads_per_group:
            allowed = [g for g in range(2, heads + 1) if heads % g == 0]
            raise ValueError(
                f"heads_per_group must divide the model's {heads} KV heads; allowed: {allowed} or None, "
                f"got {self.heads_per_group}"
            )

    def _group(self, heads: int) -> int:
        if self.heads_per_group is None:
            raise ValueError(
                "shared_heads without heads_per_group needs the model's config (make_cache(spec, model.config))"
            )
        self.check_kv_heads(heads)
        return self.heads_per_group

    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor:
        b, h, t, d = states.shape
        g = self._group(h)
        return states.reshape(b, h // g, g, t, d).float().mean(2).to(states.dtype)

    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return reduced.repeat_interleave(self.heads_per_store, dim=1).to(dtype)

    def stored_fraction(self, head_dim: int) -> tuple[int, float]:
        return head_dim, self.heads_per_store
