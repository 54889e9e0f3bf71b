"""KVzip's reconstruction pass: after the prompt, the model reads it again; its queries score the kept slots.

The cache cannot call the model itself: generation.prefill feeds the repeated prompt between
`begin_reconstruction` and `end_reconstruction` (through CompressedCache), and `reconstruction_queries` marks the
queries of each step that count. During the pass a layer attends over what it keeps plus the step's tokens and
keeps nothing new; when its policy scores by reconstruction, it records the most attention each kept slot receives
and the pass's end evicts by those scores.
"""

from __future__ import annotations

import torch

from .requests import ENABLE_ATTENTION_HINT, AttentionRequest


class Reconstruction:
    """CompressedLayer's reconstruction pass (a mixin): `reconstruction_queries` [B, q] while it runs, `scored`
    once it has scored the kept slots into `accumulated`."""

    def _check_reconstructed(self, new: int) -> None:
        """Refuse to decode past the budget with a policy whose pass has not run (model.generate alone)."""
        if self.policy.scores_by_reconstruction and not self.scored and new == 1 and self._over_budget():
            raise RuntimeError(
                f"{type(self.policy).__name__} compresses a prompt after reading it again: prefill it with "
                "hf_kvcompress.prefill(model, input_ids, attention_mask, cache, repeat_prompt_ids=...) (or "
                "hf_kvcompress.generation.generate), not with model.generate alone"
            )

    def begin_reconstruction(self) -> None:
        if self.is_initialized and self.policy.scores_by_reconstruction:
            self.slots.accumulated = torch.zeros(
                self.batch_size, self.kv_heads, self.stored_tokens, device=self.device, dtype=torch.float32
            )

    def _reconstruction_step(self, key_states, value_states, attn_kwargs):
        """Attend over kept + reconstruction tokens, keep nothing new, and take the max attention per kept slot."""
        self._check_shape(key_states, value_states)
        full_keys = torch.cat([self._full("key"), key_states], dim=-2)
        full_values = torch.cat([self._full("value"), value_states], dim=-2)
        self.peak_tokens = max(self.peak_tokens, full_keys.shape[-2])
        if self.policy.scores_by_reconstruction:
            self._request_attention(attn_kwargs, AttentionRequest(
                self._observe_reconstruction, None, "max", self.reconstruction_queries
            ))
        return full_keys, full_values

    def _observe_reconstruction(self, attention: torch.Tensor) -> None:
        stored = self.slots.accumulated.shape[-1]
        self.slots.accumulated = torch.maximum(self.slots.accumulated, attention[..., :stored].to(torch.float32))
        self.awaiting_attention = False

    def check_attention_served(self) -> None:
        """Refuse a reconstruction step whose attention statistics never arrived (the model runs another attention
        function): the pass would end with every score 0 and evict arbitrary slots."""
        if self.reconstruction_queries is not None and self.awaiting_attention:
            self.awaiting_attention = False
            raise RuntimeError(f"{type(self.policy).__name__} scores tokens by attention: {ENABLE_ATTENTION_HINT}")

    def end_reconstruction(self, evict: bool = True) -> None:
        """Evict the lowest-scored slots down to the budget (`evict=False`: the pass failed; keep every slot unscored)."""
        self.reconstruction_queries = None
        self.awaiting_attention = False
        if not evict:
            if self.policy.scores_by_reconstruction:
                self.slots.accumulated = None
            return
        if self.is_initialized and self.policy.scores_by_reconstruction:
            self.scored = True
            self._compress()
