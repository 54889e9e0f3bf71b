"""What CompressedLayer's mixins (eviction.py, block_eviction.py, codec_sinks.py, rerotation.py, store_offer.py,
finite_check.py, layer_state.py) read from the layer and call on each other, declared once for the type checker.

Each mixin derives from `LayerFields`, which holds annotations only (and, for the type checker alone, the
signatures of the methods the mixins call across modules): at run time it adds no attribute and no method, so the
layer's behaviour and method resolution are those of layer.py. CompressedLayer sets the attributes in `__init__`,
`_clear` and `lazy_initialization` (or `import_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..codecs.base import Codec, Kind
    from ..policies.base import Policy
    from .head_store import HeadStore
    from .padding import RowPadding
    from .scorers import Scorer
    from .slot_records import SlotRecords
    from .storage import TokenStore


class LayerFields:
    """The layer's fields that its mixins read (see layer.py for what each holds)."""

    policy: Policy
    codec: Codec
    scorer: Scorer
    inv_freq: torch.Tensor | None
    # From the first step on (`lazy_initialization`, `import_state`); a `HeadStore` after KVzip's head ranking,
    # which also drops `padding` (the store counts each row's real tokens).
    store: TokenStore | HeadStore | None
    padding: RowPadding | None
    slots: SlotRecords
    budget_shift: torch.Tensor | None
    seen: int
    peak_tokens: int
    is_initialized: bool
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    kv_heads: int
    head_dim: int
    value_dim: int

    if TYPE_CHECKING:
        # Defined by CompressedLayer or by another mixin; declared here so each mixin is checked on its own.
        @property
        def stored_tokens(self) -> int: ...

        @property
        def per_head(self) -> bool: ...

        @property
        def reconstruction_queries(self) -> torch.Tensor | None: ...

        def _clear(self) -> None: ...

        def _full(self, kind: Kind) -> torch.Tensor: ...

        def _encode_tail(self) -> None: ...

        def _compress(self) -> None: ...

        def _capture_sinks(self) -> None: ...

        def _drop_old_blocks(self) -> None: ...

        def _rerotate_kept(self) -> None: ...

        def _flush_finite_check(self) -> None: ...
