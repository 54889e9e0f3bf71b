"""The fused decode path: a layer offers attention its encoded store instead of decoding it for the step.

Our attention function (hf/attention.py) takes the offer and reads the store a block at a time
(caches/store_attention.py); the layer evicts and encodes only after that attention ran. Once an offer has been
taken, `update` returns NaN placeholders instead of the decoded cache, so the layer must learn at the next step
whether the offer was taken again, and refuse to go on when it was not. Prompt steps ask without relying on the
answer (`StoreOffers.probe`), so the first decode step is already fused, and a prompt run through another attention
function withdraws the confirmation instead of leaving a decode step to fail. A layer whose request never reached
our attention function says so once (`StoreOffers.note`): the model runs another one, and every decode step decodes
the whole store.
"""

from __future__ import annotations

import warnings

import torch

from ..codecs.base import Codec
from .requests import ENABLE_ATTENTION_HINT, STORE_KEY, STORE_NOT_REACHED, AttendsStore, StoreRequest
from .storage import TokenStore


class StoreOffers:
    """A layer's store offers: `request`, offered at the last step, and `confirmed` once our attention function has
    taken one."""

    def __init__(self, codec: Codec, rerotates: bool) -> None:
        self.codec = codec
        # A re-rotating layer rotates its kept keys after attention, so attention must read them decoded.
        self.offered = codec.attends_encoded and not rerotates
        self.noted = False  # said that no attention function reads the store (once in the layer's life)
        self.clear()

    def clear(self) -> None:
        """A reset layer offers afresh (what it said stays said)."""
        self.request: StoreRequest | None = None
        self.probing = False  # `request` came from a prompt step's probe (or a quiet offer): unanswered, unnoted
        self.confirmed = False

    def may_attend(self, store: TokenStore, attn_kwargs: dict | None, new: int) -> bool:
        """Whether this decode step can let attention read the encoded store itself (caches/store_attention.py)."""
        return (
            self.offered and new == 1 and attn_kwargs is not None and store.holds_encoded
            and store.exact_keys is None  # exact states over some encoded slots: read decoded
        )

    def probe(self, layer: AttendsStore, attn_kwargs: dict | None, new: int) -> None:
        """A prompt step asks, without relying on the answer, whether our attention function runs here (it marks
        the request used and attends as usual): then the first decode step is already fused instead of decoding
        the whole store once to find out (docs/benchmark-notes.md)."""
        if self.offered and new > 1 and attn_kwargs is not None:
            self.request, self.probing = StoreRequest(layer, fused=False), True
            attn_kwargs[STORE_KEY] = self.request

    def offer(self, layer: AttendsStore, attn_kwargs: dict, shape_keys: tuple, shape_values: tuple, dtype, device,
              quiet: bool = False):
        """Offer attention the store; the placeholders `update` returns when our attention function takes it (None:
        it has not taken one yet, so `update` returns the decoded store as well). `quiet`: an unanswered offer goes
        unnoted (a head store's step also hands attention its own mask, whose check names the problem)."""
        self.request, self.probing = StoreRequest(layer, fused=self.confirmed), quiet and not self.confirmed
        attn_kwargs[STORE_KEY] = self.request
        if not self.confirmed:
            return None
        # Our attention function reads the store block by block and then calls the layer's eviction (the step's
        # attention must see the state before eviction and encoding). What update returns is never read:
        # placeholders that cost nothing and are NaN, so that any other attention function fails loudly
        # (and the next update raises).
        placeholder = torch.full((), float("nan"), dtype=dtype, device=device)
        return placeholder.expand(*shape_keys), placeholder.expand(*shape_values)

    def check_used(self) -> None:
        """After a step that offered attention the store: learn whether our attention function took it."""
        request, self.request = self.request, None
        probed, self.probing = self.probing, False
        if request is None:
            return
        if request.fused and not request.used:
            self.confirmed = False
            raise RuntimeError(
                "the last decode step's attention did not run through 'kvcompress_sdpa', which this cache had "
                "relied on (the attention implementation changed mid-generation?): that step's output is invalid; "
                "call cache.reset() and generate again"
            )
        self.confirmed = request.used
        # An unanswered probe withdraws the confirmation but says nothing: states can reach `update` with no
        # attention after them (shared_prefill.replay fills a cache from another cache's states), and a model that
        # really runs another attention function is named at the first decode offer it leaves unanswered.
        if not request.reached and not self.noted and not probed:
            self.noted = True
            self.note(None)

    def note(self, attention: str | None) -> None:
        """Say that decode attention does not read this layer's store (`attention`: the model's implementation,
        when the cache knows it); the cache says it once for all its layers, naming the model's attention."""
        named = "" if attention is None else f" (it runs {attention!r})"
        warnings.warn(STORE_NOT_REACHED.format(codec=self.codec.spec(), named=named, hint=ENABLE_ATTENTION_HINT),
                      RuntimeWarning, stacklevel=4)
