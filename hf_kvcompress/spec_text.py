"""Spec strings from dataclass fields: `name:k=v,...` lists only what differs from the defaults.

Policies and codecs write their own spec strings with this, so they never need the registry (which imports them).
"""

from __future__ import annotations

import dataclasses


def changed_fields(obj, skip=(), defaults=None) -> str:
    """`k=v,...` for the init fields of dataclass `obj` that differ from their defaults.

    `defaults` overrides the dataclass's own (int4's defaults are the best 4-bit configuration, not the class's);
    defaults filled in by __post_init__ (budget=512 when neither budget nor ratio is given) count as defaults.
    """
    defaults = defaults or {}
    try:
        reference = type(obj)()
    except (TypeError, ValueError):
        reference = None
    items = []
    for f in dataclasses.fields(obj):
        if f.name in skip or not f.init:
            continue
        value = getattr(obj, f.name)
        default = defaults.get(f.name, getattr(reference, f.name) if reference is not None else f.default)
        if value is None and f.default is None and f.name not in defaults:
            continue
        if value != default:
            items.append(f"{f.name}={'none' if value is None else value}")
    return ",".join(items)


def join_spec(name: str, args: str) -> str:
    return f"{name}:{args}" if args else name


def pin_fields(spec: str, fields: dict) -> str:
    """`spec` (`name` or `name:k=v,...`) with `k=v` added for each of `fields` it does not name already: a value
    equal to the plain name's default is left out of `changed_fields`, but where a stack gives its storage other
    defaults (`ReducingCodec.storage_defaults`) the spec must name it to rebuild the same codec."""
    name, _, args = spec.partition(":")
    named = {item.partition("=")[0] for item in args.split(",") if item}
    extra = [f"{key}={'none' if value is None else value}" for key, value in fields.items() if key not in named]
    return join_spec(name, ",".join(filter(None, [args, *extra])))
