"""Count the times tensor values are read back on the host: on a GPU each read stalls the launch queue."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# `int(t)`, `bool(t)`, `float(t)`, `t.item()` reach one of the first three (which one depends on inference mode);
# `torch.equal` and `nonzero` (an output shape that depends on values) wait for the device too. `tolist` is not seen.
_READS = {
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default, torch.ops.aten.nonzero.default,
}


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as c: ...` counts host reads of tensor values in `c.count` (CPU or GPU alike).

    On CPU a read costs nothing much, so a speed test there cannot see it; this count can."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
