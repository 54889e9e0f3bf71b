"""What a cache object really holds in memory, as opposed to what a formula says it should.

Imports only torch: benchmarks/harness/bench_measure.py loads this file by path in the peers' environments
(transformers' QuantizedCache, kvpress), where hf_kvcompress is not installed, so every cache's bytes are counted the
same way."""

from __future__ import annotations

import torch


def _leaves(tensor: torch.Tensor):
    """The plain tensors that hold a tensor's data: itself, or the parts of a wrapper subclass (quanto's QTensors
    keep their codes, scales and shifts in inner tensors; the wrapper owns no storage of its own)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield tensor
        return
    for name in flatten()[0]:
        yield from _leaves(getattr(tensor, name))


def _tensors(obj, seen: set[int]):
    """Yield every plain tensor reachable from `obj` through attributes, dicts, lists and tuples."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for value in vars(obj).values():
            yield from _tensors(value, seen)


def measured_kv_bytes(cache) -> int:
    """Bytes of tensor storage a cache owns, each storage counted once.

    Counting whole storages (not tensor views) is the point: a cache that keeps a small slice of a large buffer
    still pins the large buffer, and this number shows it.
    """
    layers = getattr(cache, "layers", None)
    roots = layers if layers is not None else [cache]
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    for root in roots:
        for tensor in _tensors(root, seen):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def served_kv_bytes(cache, dtype: torch.dtype) -> int:
    """What `measured_kv_bytes` would read had the model run in `dtype` (the dtype it is served in; a CPU runs it
    in float32): the measured storage with the keys and values re-counted at `dtype`'s width. Codes, scales,
    scores and positions keep their own dtypes. A cache with `promised_kv_bytes(dtype)` (this package's) re-counts
    itself; any other (transformers' DynamicCache) holds only keys and values, so its floating storage scales.
    tests/test_served_bytes.py checks it against the same caches run in `dtype`."""
    measured = measured_kv_bytes(cache)
    promised = getattr(cache, "promised_kv_bytes", None)
    if promised is not None:
        return int(measured - promised() + promised(dtype))
    width = torch.empty((), dtype=dtype).element_size()
    storages: dict[tuple, tuple[int, torch.dtype]] = {}
    seen: set[int] = set()
    for root in getattr(cache, "layers", None) or [cache]:
        for tensor in _tensors(root, seen):
            if tensor.device.type != "meta":
                storages[(tensor.device, tensor.untyped_storage().data_ptr())] = (
                    tensor.untyped_storage().nbytes(), tensor.dtype)
    return int(sum(n // t.itemsize * width if t.is_floating_point else n for n, t in storages.values()))
