"""The fused decode path: a layer offers attention its encoded store instead of decoding it for the step.

Our attention function (hf/attention.py) takes the offer and reads the store a block at a time
(caches/store_attention.py); the layer evicts and encodes only after that attention ran. Once an offer has been
taken, `update` returns NaN placeholders instead of the decoded cache, so the layer must learn at the next step
whether the offer was taken again, and refuse to go on when it was not. Prompt steps ask without relying on the
answer (`_probe_store`), so the first decode step is already fused, and a prompt run through another attention
function withdraws the confirmation instead of leaving a decode step to fail. A layer whose request never reached
our attention function says so once (`store_note`): the model runs another one, and every decode step decodes the
whole store.
"""

from __future__ import annotations

import warnings

import torch

from .layer_fields import LayerFields
from .requests import ENABLE_ATTENTION_HINT, STORE_KEY, STORE_NOT_REACHED, StoreRequest
from .storage import TokenStore
from .store_attention import attend_store


class StoreOffer(LayerFields):
    """CompressedLayer's store offers (a mixin): `store_request` offered at the last step, and `store_confirmed`
    once our attention function has taken one."""

    store_request: StoreRequest | None
    store_confirmed: bool
    store_noted: bool  # said that no attention function reads the store (set in CompressedLayer.__init__)

    def _may_attend_store(self, attn_kwargs: dict | None, new: int) -> bool:
        """Whether this decode step can let attention read the encoded store itself (caches/store_attention.py)."""
        assert isinstance(self.store, TokenStore)  # a token layer's step (a head store steps in `_per_head_step`)
        return (
            new == 1 and attn_kwargs is not None and self.store.encoded_keys is not None and self.codec.attends_encoded
            and self.inv_freq is None and self.reconstruction_queries is None
            and self.store.exact_keys is None  # exact states over some encoded slots: read through `_full`
        )

    def _probe_store(self, attn_kwargs: dict | None, new: int) -> None:
        """A prompt step asks, without relying on the answer, whether our attention function runs here (it marks
        the request used and attends as usual): then the first decode step is already fused instead of decoding
        the whole store once to find out (docs/benchmark-notes.md)."""
        if new > 1 and attn_kwargs is not None and self.codec.attends_encoded and self.inv_freq is None:
            self.store_request = StoreRequest(self, fused=False)
            attn_kwargs[STORE_KEY] = self.store_request

    def _offer_store(self, attn_kwargs: dict, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Offer attention the store; the placeholders `update` returns when our attention function takes it."""
        self.store_request = StoreRequest(self, fused=self.store_confirmed)
        attn_kwargs[STORE_KEY] = self.store_request
        if not self.store_confirmed:
            return None
        # Our attention function reads the store block by block and then calls `_compress` (the step's
        # attention must see the state before eviction and encoding). What update returns is never read:
        # placeholders that cost nothing and are NaN, so that any other attention function fails loudly
        # (and the next update raises).
        placeholder = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
        return (
            placeholder.expand(self.batch_size, self.kv_heads, length, self.head_dim),
            placeholder.expand(self.batch_size, self.kv_heads, length, self.value_dim),
        )

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Called by our attention function for a fused step: attention over what this layer holds, then the
        step's eviction and encoding."""
        output = attend_store(self, query, attention_mask, scaling)
        self._compress()
        return output

    def check_store_used(self) -> None:
        """After a step that offered attention the store: learn whether our attention function took it."""
        request, self.store_request = self.store_request, None
        if request is None:
            return
        if request.fused and not request.used:
            self.store_confirmed = False
            raise RuntimeError(
                "the last decode step's attention did not run through 'kvcompress_sdpa', which this cache had "
                "relied on (the attention implementation changed mid-generation?): that step's output is invalid; "
                "call cache.reset() and generate again"
            )
        self.store_confirmed = request.used
        if not request.reached and not self.store_noted:
            self.store_noted = True
            self.store_note(None)

    def store_note(self, attention: str | None) -> None:
        """Say that decode attention does not read this layer's store (`attention`: the model's implementation,
        when the cache knows it); the cache says it once for all its layers, naming the model's attention."""
        named = "" if attention is None else f" (it runs {attention!r})"
        warnings.warn(STORE_NOT_REACHED.format(codec=self.codec.spec(), named=named, hint=ENABLE_ATTENTION_HINT),
                      RuntimeWarning, stacklevel=4)
