"""hf-kvcompress: smaller KV caches for transformers models, and measurements of what they cost in quality."""

import importlib

# The one place the version is written (pyproject.toml reads it): the eval runner stamps results with it, and an
# editable install's metadata keeps the version it was installed at, so it reads this, not the metadata.
__version__ = "0.5.0"

# Each public name and the module that defines it. They import on first use (PEP 562), as transformers' own
# top-level names do: `hf-kvcompress --help` then reads no torch, and `import hf_kvcompress` patches nothing.
_EXPORTS = {
    ".caches.compressed": ["CompressedCache"],
    ".persist": ["load_cache", "save_cache"],
    ".caches.presets": ["Fp8Cache", "HeavyHitterCache", "QuantizedCache", "SinkWindowCache"],
    ".codecs.fp8": ["Fp8Codec"],
    ".codecs.identity": ["IdentityCodec"],
    ".codecs.intn": ["IntNCodec"],
    ".document": ["Document", "compress_document", "load_document"],
    ".generation": ["prefill", "repeat_prompt_ids"],
    ".hf.attention": ["use_kvcompress_attention"],
    ".measure": ["measured_kv_bytes"],
    ".policies.expected_attention": ["ExpectedAttentionPolicy"],
    ".policies.heavy_hitter": ["HeavyHitterPolicy"],
    ".policies.keep_all": ["KeepAllPolicy"],
    ".policies.keydiff": ["KeyDiffPolicy"],
    ".policies.kvzip": ["KVzipPolicy"],
    ".policies.kvzap": ["KVzapPolicy"],
    ".policies.random": ["RandomPolicy"],
    ".policies.sink_window": ["SinkWindowPolicy"],
    ".policies.snapkv": ["SnapKVPolicy"],
    ".policies.tova": ["TOVAPolicy"],
    ".registry": ["make_cache", "parse_spec"],
    ".models": ["load_model", "load_config"],
    ".budget": ["kv_bytes"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_MODULE_OF])


__all__ = sorted(name for name in _MODULE_OF if name not in ("load_model", "load_config", "kv_bytes"))
