"""Saved caches (prompt caching): compress a long document once, load it later to ask it many questions.

One safetensors file holds every layer's tensors exactly as the cache stores them (encoded bytes included), and its
metadata the spec, the model's name and config, and each layer's shapes, so a loaded cache holds the very same
bytes and gives the very same answers, and refuses another model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from .caches.compressed import CompressedCache
from .caches.plan import config_layer_types, is_hybrid, planned_share, planned_sliding_tokens
from .codecs.base import Codec
from .hf.compat import text_config
from .registry import parse_spec

FORMAT = "hf-kvcompress-cache/1"
# The byte plan's codec (plan.py `byte_plan_codec`) in files saved before they recorded it (`byte_codec`).
BYTE_CODEC_BEFORE = "int4:residual_length=32"


def model_name(config) -> str:
    """A model's name as a saved cache records it: the last part of its Hub id or local path."""
    name = str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")
    return Path(name.rstrip("/")).name or "unknown"


def _architecture(config) -> dict:
    decoder = text_config(config)
    keys = ("model_type", "num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size",
            "head_dim", "vocab_size", "sliding_window", "layer_types")
    return {k: getattr(decoder, k, None) for k in keys}


def save_cache(cache: CompressedCache, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write `cache` (built with `config=model.config`) to a safetensors file.

    `metadata`: more string entries for the file's metadata (a Document keeps its text there); they cannot replace
    the cache's own entries. `safetensors.safe_open(path, "pt").metadata()` reads them back.
    """
    if not isinstance(cache, CompressedCache):
        raise ValueError(f"cache must be an hf_kvcompress CompressedCache, got {type(cache).__name__}")
    if cache.config is None:
        raise ValueError("save_cache needs a cache built with config=model.config (make_cache(spec, model.config))")
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict | None] = []  # None: a layer that never saw a step
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            layers.append(None)
            continue
        layer_tensors, meta = layer.export_state()
        meta["shapes"] = {name: list(t.shape) for name, t in layer_tensors.items()}
        layers.append(meta)
        tensors.update({f"layers.{i}.{name}": t.contiguous() for name, t in layer_tensors.items()})
    if not tensors:
        raise ValueError("the cache is empty: prefill it before saving")
    extra = dict(metadata or {})
    own = {
        "format": FORMAT,
        "spec": cache.spec,
        "rerotate": json.dumps(cache.rerotate),
        # Whether the sliding layers were planned (a plain ratio or bytes=); files without it were saved before a plain
        # KVzip ratio shared a hybrid model's pairs: they load as built. A byte target is planned even where its
        # sliding layers keep their whole window (no count: from about bytes=0.32 up, a plain ratio of a half).
        "sliding_share": json.dumps(cache.planned_sliding is not None or cache.byte_target is not None),
        # The planned sliding layers' count as built; files without it were planned by r x r (`_r2_sliding`).
        "sliding_kept": json.dumps(cache.planned_sliding),
        # Whether KVzip's bytes= stored a hybrid model's sliding layers in the plan's int4 (plan.py `byte_codecs`);
        # files without it were saved before, with the spec's codec in every layer, and load so.
        "byte_plan": json.dumps(True),
        # The byte plan's codec (plan.py `byte_plan_codec` when saved) as the cache applied it; null: no byte plan.
        # Files with `byte_plan` but without it were saved when the plan's codec was `int4:residual_length=32`.
        "byte_codec": json.dumps(cache.byte_codec.spec() if cache.byte_codec is not None else None),
        # KVzip's or KVzap's `decoding` as the cache ran it: files without it were saved before "append" was a
        # default, and load as they ran ("evict").
        "decoding": json.dumps(getattr(cache.policy, "resolved_decoding", None)),
        # Whether the head stores of one ranking hold one allowance together (head_store.py `RankedTogether`);
        # files without it were saved when each layer held its own, and load so.
        "ranked_together": json.dumps(cache.ranked_together),
        "model_name": model_name(cache.config),
        "architecture": json.dumps(_architecture(cache.config)),
        "config": cache.config.to_json_string(use_diff=False),
        "layers": json.dumps(layers),
        "device": str(next(layer.device for layer in cache.layers if layer.is_initialized)),
    }
    clash = sorted(set(extra) & set(own))
    if clash or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise ValueError(
            f"metadata must map new names to strings (the cache's own entries are {sorted(own)}), got {clash or extra}"
        )
    save_file(tensors, str(path), metadata={**extra, **own})


def load_cache(path: str | os.PathLike, device: str | torch.device | None = None, model=None) -> CompressedCache:
    """A cache holding what `save_cache` wrote, on `device` (default: where it was saved; "cpu", "cuda:0", ...).

    Pass `model` to have its name and architecture checked against the saved ones now; `generate` in this package
    checks them in any case before using the cache.
    """
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a cache saved by hf_kvcompress.save_cache (format {metadata.get('format')!r})")
    config_dict = json.loads(metadata["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    config._name_or_path = metadata["model_name"]
    # Read as written: since a stack's storage took defaults of its own (`ReducingCodec.storage_defaults`), a saved
    # spec names those fields (`ReducingCodec.spec`); a file saved before names none and was built with the plain
    # storage's (`lowrank:ratio=0.5+int4`: int4's group of 32 and residual of 128).
    policy, codec = parse_spec(metadata["spec"], storage_defaults=False)
    # KVzip's or KVzap's `decoding` as the saved cache ran it; null or absent: saved before the policy took one
    # (KVzap) or before "append" was a default (KVzip), when it evicted.
    ran = json.loads(metadata.get("decoding", "null")) or "evict"
    if getattr(policy, "resolved_decoding", ran) != ran:  # another default then: the file's
        policy = dataclasses.replace(policy, decoding=ran)  # type: ignore[call-arg]  # KVzip or KVzap: checked
    # A saved cache's spec names its span (the cache settles it, `Policy.for_layout`); a KVzip or KVzap spec without
    # one was saved when 4 was every model's default.
    if getattr(policy, "span", 0) is None:
        policy = dataclasses.replace(policy, span=4)  # type: ignore[call-arg]  # a KVzip or KVzap policy: checked
    shared = json.loads(metadata.get("sliding_share", "false"))
    planned_sliding = json.loads(metadata.get("sliding_kept", "null"))
    if shared and "sliding_kept" not in metadata:
        planned_sliding = _r2_sliding(policy, config)
    # The byte plan's codecs (plan.py `byte_codecs`) matter on load for a hybrid model's sliding layers only: the
    # spec names the codec the full-attention layers ran (a plain bytes= its int4 since the plan stored them so), and
    # a plain bytes= spec on a model without sliding layers was saved when that plan kept its exact pairs.
    byte_plan = json.loads(metadata.get("byte_plan", "false")) and is_hybrid(config_layer_types(config))
    # The sliding layers' codec under that plan: the file's own, or the plan's codec before files recorded it.
    saved_codec = json.loads(metadata["byte_codec"]) if "byte_codec" in metadata else BYTE_CODEC_BEFORE
    byte_codec = _codec(saved_codec) if saved_codec is not None else None
    # ratio_bytes=False: a cache whose plain ratio was planned as a byte target saved its spec with that `bytes=`
    # (CompressedCache names what it runs), so a ratio in a saved spec was planned by its own rule and loads so.
    cache = CompressedCache(policy, codec, config=config, rerotate=json.loads(metadata["rerotate"]),
                            share_sliding=shared, planned_sliding=planned_sliding, byte_plan=byte_plan,
                            ratio_bytes=False, byte_codec=byte_codec)
    cache.model_name = metadata["model_name"]
    cache.architecture = json.loads(metadata["architecture"])
    if model is not None:
        check_model(cache, model)
    tensors = load_file(str(path), device="cpu")
    layers = json.loads(metadata["layers"])
    if len(layers) != len(cache.layers):
        raise ValueError(f"{path} holds {len(layers)} layers, its spec and config build {len(cache.layers)}")
    for i, (layer, meta) in enumerate(zip(cache.layers, layers, strict=True)):
        if meta is None:
            continue
        prefix = f"layers.{i}."
        layer_tensors = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        target = torch.device(device if device is not None else metadata["device"])
        layer.import_state(layer_tensors, meta, target)  # meta `kind` selects the store kind (layer.py `import_state`)
    if json.loads(metadata.get("ranked_together", "false")):
        cache.rank_together()
    return cache


def _codec(spec: str) -> Codec:
    """The codec a saved codec spec names (`Codec.spec()`'s string, as `save_cache` wrote it)."""
    policy, codec = parse_spec(spec)
    if policy.spec() != "dynamic":
        raise ValueError(f"a saved byte plan's codec must be a codec spec such as 'int4', got {spec!r}")
    return codec


def _r2_sliding(policy, config) -> int:
    """The tokens a planned sliding layer kept in files saved before they recorded it (`sliding_kept`): r x r of
    its window (r: the planned share), at least SLIDING_FLOOR of it, at most the share."""
    share = planned_share(policy)
    assert share is not None  # saved with a planned share: a ratio or KVzip's bytes
    return planned_sliding_tokens(share, max(text_config(config).sliding_window - 1, 1), rule=lambda r: r * r)


def check_model(cache, model) -> None:
    """Raise ValueError if a loaded cache is about to serve another model than the one it was saved from."""
    saved = getattr(cache, "model_name", None)
    if saved is None:
        return
    name = model_name(model.config)
    if name != saved:
        raise ValueError(f"this cache was saved from model {saved!r}; it cannot serve {name!r}")
    if _architecture(model.config) != cache.architecture:
        raise ValueError(
            f"this cache was saved from a model with {cache.architecture}, not {_architecture(model.config)}"
        )
