"""A sliding window over per-channel key groups: the oldest whole blocks go once all their tokens left the window.

Per-channel key groups (KIVI) quantize a block of tokens together, so a sliding layer that stores them cannot drop
one token per step as the exact window does. It drops the oldest `block` tokens at a time, from the encoded store
(whole encoded blocks, cut without decoding) and then from the full-precision tail, only when every one of them is
older than the window: the layer holds between `window` and `window + block - 1` tokens (policies/block_window.py).
Dropping a whole number of blocks from slot 0 keeps slot 0 on a block boundary of the row's tokens, so a row left-padded
by whole blocks is grouped as when run alone. Slots stay the newest tokens in order, so `get_mask_sizes` (stored +
query, seen - stored) still gives each slot its absolute position and transformers' sliding mask hides the older
ones; attention paths that build their own mask must honour the window too (padding.py `RowPadding.mask`).
"""

from __future__ import annotations

from ..policies.block_window import BlockWindowPolicy
from .layer_fields import LayerFields
from .storage import TokenStore


class BlockEviction(LayerFields):
    """CompressedLayer's block window (a mixin), for policies whose `drops_blocks` is True."""

    def _drop_old_blocks(self) -> None:
        """Drop the oldest whole blocks of `policy.block` tokens that lie entirely before the newest
        `policy.window` tokens, and move every per-slot record along."""
        assert isinstance(self.policy, BlockWindowPolicy)  # the only policy whose `drops_blocks` is True
        # A token layer after its first step: a block window is never ranked into a head store.
        assert isinstance(self.store, TokenStore) and self.padding is not None
        drop = self.stored_tokens - self.policy.held(self.stored_tokens)
        if drop == 0:
            return
        if self.store.encoded_keys is None:
            self._capture_sinks()  # while the tail still holds every token seen
        self.padding.evicting()
        self.store.drop(drop)
        self.padding.drop(drop)  # padding is the oldest slots
        # Every per-slot record loses the same slots; a sink whose block is dropped is gone, as when the exact
        # window passes it.
        self.slots.drop(drop)
