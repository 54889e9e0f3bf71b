"""Every policy and codec by name, and the spec strings that combine them: `NAME[:k=v,...][+CODEC[:k=v,...]]`.

The CLI, the evaluation suite, lm-eval and the study all build caches from these strings, so a method added here
is available everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

# cache_spec (a cache's spec string) lives beside the cache, which names itself by it and never imports the registry.
from .caches.compressed import CompressedCache, cache_spec  # noqa: F401 (re-exported)
from .codecs.base import Codec
from .codecs.fp8 import Fp8Codec
from .codecs.identity import IdentityCodec
from .codecs.intn import PLAIN_NAME_DEFAULTS, IntNCodec
from .codecs.lowrank import LowRankCodec
from .codecs.reducing import ReducingCodec
from .codecs.shared_heads import SharedHeadsCodec
from .policies.base import Policy
from .policies.expected_attention import ExpectedAttentionPolicy
from .policies.heavy_hitter import HeavyHitterPolicy
from .policies.keep_all import KeepAllPolicy
from .policies.keydiff import KeyDiffPolicy
from .policies.kvzap import KVzapPolicy
from .policies.kvzip import KVzipPolicy
from .policies.random import RandomPolicy
from .policies.sink_window import SinkWindowPolicy
from .policies.snapkv import SnapKVPolicy
from .policies.tova import TOVAPolicy

POLICIES: dict[str, type[Policy]] = {
    "dynamic": KeepAllPolicy,
    "sink_window": SinkWindowPolicy,
    "h2o": HeavyHitterPolicy,
    "snapkv": SnapKVPolicy,
    "tova": TOVAPolicy,
    "keydiff": KeyDiffPolicy,
    "expected_attention": ExpectedAttentionPolicy,
    "random": RandomPolicy,
    "kvzip": KVzipPolicy,
    "kvzap": KVzapPolicy,
}
POLICY_ALIASES = {"keep_all": "dynamic", "full": "dynamic", "streaming_llm": "sink_window", "heavy_hitter": "h2o"}

CODECS: dict[str, Callable[..., Codec]] = {  # a codec class, or a partial of one
    "identity": IdentityCodec,
    "fp8": Fp8Codec,
    "int8": partial(IntNCodec, bits=8),
    "int4": partial(IntNCodec, bits=4, **PLAIN_NAME_DEFAULTS[4]),
    "int3": partial(IntNCodec, bits=3, **PLAIN_NAME_DEFAULTS[3]),
    "int2": partial(IntNCodec, bits=2, **PLAIN_NAME_DEFAULTS[2]),
    "shared_heads": SharedHeadsCodec,
    "lowrank": LowRankCodec,
}

# The plans a study compares: every family of the lesson at its best measured setting (docs/study.md, "Each family
# at its best measured setting") and the combinations it stacks. `{budget}`, `{window}` and `{half_dim}` are filled
# in from the context length and the model, so new policies and codecs join the study by adding a line here.
# Every plan but KVzap's reuses the study's one shared prefill per document (`shared_prefill.py`); KVzip adds only
# its reconstruction pass (about 1.8 prefills); KVzap's probe reads each token's hidden state as it arrives, so it
# prefills on its own, with the attention hooks (`eval.runner.AttentionSwitch`). fp8 left to make room for KVzap
# and the reduced-state settings within make demo's 10 minutes: it prefills on its own too (4.7 CPU s of the 33 per
# sample, docs/study.md), and its family, quantization, is int8's (the same bytes) and int4's (`--plans` adds it).
# The evictions keep a quarter, sinks + window's share, so the rules compare at the same bytes. Shared heads by
# calibrated maps need the model's shipped maps and more than one KV head: a model without them has the plan
# refused, with the reason, in the study's report (`commands.study._usable_plans`). Group means (`shared_heads`), a
# quarter of head_dim (`lowrank`) and group means + int8 answered no needle (docs/study.md): not in the study.
STUDY_PLANS: tuple[str, ...] = (
    "dynamic",
    "int8",
    "int4",
    "sink_window:sink_tokens=4,window={window}",
    "kvzip:ratio=0.25",
    "kvzap:ratio=0.25",
    "shared_heads:ratio=0.67",
    "lowrank:ratio=0.5",
    "lowrank:ratio=0.5+int4",
    "sink_window:sink_tokens=4,window={window}+int4",
)
# Evictions that decide what to keep from the prefill itself: H2O and SnapKV read its attention, so each runs its
# own prefill, and they have a study of their own (`hf-kvcompress study --preset eviction`), with KVzip at the
# same budget, alone and in int4.
EVICTION_STUDY_PLANS: tuple[str, ...] = (
    "dynamic",
    "sink_window:sink_tokens=4,window={window}",
    "h2o:budget={budget},recent={recent}",
    "snapkv:budget={budget}",
    "kvzip:budget={budget}",
    "kvzip:budget={budget}+int4",
)


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _parse_part(part: str) -> tuple[str, dict]:
    name, _, args = part.partition(":")
    kwargs = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"spec arguments must be key=value, got {item!r} in {part!r}")
        kwargs[key.strip()] = parse_value(value.strip())
    return name.strip().lower(), kwargs


def _build(factory, kwargs: dict, what: str, name: str):
    cls = factory.func if isinstance(factory, partial) else factory
    assert dataclasses.is_dataclass(cls)  # every policy and codec of the registry is a dataclass
    allowed = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    if isinstance(factory, partial):  # the name fixes `bits`; its other keywords are defaults a spec may change
        allowed = [a for a in allowed if a != "bits"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} argument(s) {unknown} for {name!r}; allowed: {allowed or 'none'}")
    # `parse_value` read "none" as None; where None is a default of its own, the text "none" is what the spec said
    kwargs = {key: "none" if value is None and key in getattr(cls, "spec_none_is_text", ()) else value
              for key, value in kwargs.items()}
    return factory(**kwargs)


def _reducing(name: str) -> bool:
    factory = CODECS[name]
    cls = factory.func if isinstance(factory, partial) else factory
    return isinstance(cls, type) and issubclass(cls, ReducingCodec)


def _build_codecs(parts: list[str], spec: str, storage_defaults: bool = True) -> Codec:
    """`shared_heads+int8` -> SharedHeadsCodec(storage=IntNCodec(8)): reducing codecs hand their output to the next.
    `storage_defaults`: a reducing codec's defaults for its storage's fields (`ReducingCodec.storage_defaults`) fill
    in what the storage's part does not give."""
    built: list[tuple[str, dict]] = []
    for part in parts:
        codec_name, codec_kwargs = _parse_part(part)
        if codec_name not in CODECS:
            raise ValueError(f"unknown codec {codec_name!r} in {spec!r}; allowed: {sorted(CODECS)}")
        if storage_defaults and built and _reducing(built[-1][0]):
            factory = CODECS[built[-1][0]]
            reducing = factory.func if isinstance(factory, partial) else factory
            assert isinstance(reducing, type) and issubclass(reducing, ReducingCodec)  # `_reducing` checked
            codec_kwargs = {**reducing.storage_defaults(built[-1][1], codec_name), **codec_kwargs}
        built.append((codec_name, codec_kwargs))
    stackable = sorted(n for n in CODECS if _reducing(n))
    for codec_name, _ in built[:-1]:
        if not _reducing(codec_name):
            raise ValueError(
                f"only {stackable} can be followed by another codec, got {codec_name!r} first in {spec!r}"
            )
    codec = _build(CODECS[built[-1][0]], built[-1][1], "codec", built[-1][0])
    for codec_name, codec_kwargs in reversed(built[:-1]):
        if "storage" in codec_kwargs:
            raise ValueError(f"give {codec_name}'s storage as the next codec ({codec_name}+int8), not storage=")
        codec = _build(CODECS[codec_name], {**codec_kwargs, "storage": codec}, "codec", codec_name)
    return codec


def parse_spec(spec: str, storage_defaults: bool = True) -> tuple[Policy, Codec]:
    """`"h2o:budget=256,recent=64+int4"` -> (HeavyHitterPolicy(256, 64), IntNCodec(bits=4)).

    Codecs that reduce the states (shared_heads) may be followed by the codec that stores their output:
    `shared_heads+int8`, `h2o:budget=256+shared_heads+int4`. A reducing codec may give its storage defaults of its
    own (`ReducingCodec.storage_defaults`: `lowrank:ratio=0.5+int4` stores in `int4:residual_length=32`);
    `storage_defaults=False` reads the storage's part with its plain name's defaults (a spec saved before those
    defaults, `load_cache`).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cache spec must be a non-empty string like 'int4' or 'sink_window:window=256', got {spec!r}")
    if ";" in spec:
        raise ValueError(f"cache spec {spec!r} holds ';': give one spec (NAME[:k=v,...][+CODEC[:k=v,...]]); "
                         "lists of specs are separated by ',' (eval --methods) or ';' (study --plans, bench.py --specs)"
        )
    parts = spec.split("+")
    name, kwargs = _parse_part(parts[0])
    name = POLICY_ALIASES.get(name, name)
    if name in POLICIES:
        policy = _build(POLICIES[name], kwargs, "policy", name)
        codec_parts = parts[1:]
    elif name in CODECS:
        policy, codec_parts = KeepAllPolicy(), parts
    else:
        names = sorted(POLICIES) + sorted(POLICY_ALIASES) + sorted(CODECS)
        raise ValueError(f"unknown cache spec name {name!r}; allowed: {names}")
    return policy, _build_codecs(codec_parts, spec, storage_defaults) if codec_parts else IdentityCodec()


def make_cache(spec: str, config=None):
    """A fresh cache for `spec`; pass the model's config so hybrid sliding-window models are handled."""
    policy, codec = parse_spec(spec)
    return CompressedCache(policy, codec, config=config)


def needs_own_prefill(spec: str) -> bool:
    """Whether the spec's cache must see the prefill itself (its policy's attention scores, KVzip's reconstruction
    pass, or a codec whose prompt attention reads the encoded states, fp8), so it cannot be filled by replaying
    another cache's states."""
    policy, codec = parse_spec(spec)
    return (policy.needs_attention or policy.scores_by_reconstruction or policy.needs_hidden_states
            or codec.encodes_on_arrival)


def needs_attention(spec: str) -> bool:
    """Whether the spec's policy scores tokens by attention or from hidden states (the model must use
    `use_kvcompress_attention`)."""
    policy = parse_spec(spec)[0]
    return policy.needs_attention or policy.scores_by_reconstruction or policy.needs_hidden_states


def bounds_memory(spec: str) -> bool:
    """Whether the spec's memory stops growing (an eviction budget): such methods should prefill in chunks."""
    return parse_spec(spec)[0].budget is not None


def policy_spec(policy: Policy) -> str:
    return policy.spec()


def codec_spec(codec: Codec) -> str:
    return codec.spec()


def study_specs(context_tokens: int, head_dim: int = 64, plans: tuple[str, ...] = STUDY_PLANS) -> list[str]:
    """`plans` (STUDY_PLANS by default) for prompts of `context_tokens`: `{budget}` (an eviction budget) is about a
    quarter of the context, `{recent}` a quarter of that, `{window}` the budget less 4 sinks, and `{half_dim}` half
    of `head_dim`; plans without these fields (a ratio: a share of whatever the context is) pass unchanged."""
    budget = max(64, context_tokens // 4)
    recent = max(16, budget // 4)
    window = budget - 4
    return [p.format(budget=budget, recent=recent, window=window, half_dim=head_dim // 2) for p in plans]
