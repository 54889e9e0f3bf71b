"""What a cache spec means on one model, as a short hash: a stored result is reused only for the same meaning.

A spec names defaults that may change, and plain names settle per model (`int4`'s `rotate=auto` is per_token on
Gemma-3, hadamard elsewhere), so the spec and the package version alone can hide a change of meaning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ..codecs.base import resolve_for_model
from ..registry import parse_spec

_PLAIN = (str, int, float, bool, type(None))


def resolved_digest(spec: str, config) -> str:
    """Hash of every field of the spec's policy and of its codec bound to `config` (defaults, and what binding
    settled, nested storage codecs included)."""
    policy, codec = parse_spec(spec)
    text = json.dumps([_fields(policy), _fields(resolve_for_model(codec, config))], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fields(obj) -> dict:
    """The class name and every field, init=False ones included; values that are not plain data (loaded
    calibration tensors) are left out: what they were loaded from is a field."""
    out: dict[str, object] = {"class": type(obj).__name__}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _fields(value)
        elif isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
