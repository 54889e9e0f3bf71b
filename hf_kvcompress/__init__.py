"""hf-kvcompress: smaller KV caches for transformers models, and measurements of what they cost in quality."""

# The one place the version is written (pyproject.toml reads it): the eval runner stamps results with it, and an
# editable install's metadata keeps the version it was installed at, so it reads this, not the metadata.
__version__ = "0.5.0"

from .caches.compressed import CompressedCache
from .caches.persist import load_cache, save_cache
from .caches.presets import Fp8Cache, HeavyHitterCache, QuantizedCache, SinkWindowCache
from .codecs.fp8 import Fp8Codec
from .codecs.identity import IdentityCodec
from .codecs.intn import IntNCodec
from .generation import prefill, repeat_prompt_ids
from .hf.attention import use_kvcompress_attention
from .measure import measured_kv_bytes
from .policies.expected_attention import ExpectedAttentionPolicy
from .policies.heavy_hitter import HeavyHitterPolicy
from .policies.keep_all import KeepAllPolicy
from .policies.keydiff import KeyDiffPolicy
from .policies.kvzip import KVzipPolicy
from .policies.random import RandomPolicy
from .policies.sink_window import SinkWindowPolicy
from .policies.snapkv import SnapKVPolicy
from .policies.tova import TOVAPolicy
from .registry import make_cache, parse_spec


def __getattr__(name):
    # Model loading, the budget calculator and documents import lazily: they pull in heavier modules.
    if name in ("load_model", "load_config"):
        from . import models

        return getattr(models, name)
    if name == "budget":
        import importlib

        return importlib.import_module(".budget", __name__)
    if name in ("Document", "compress_document", "load_document"):  # pulls in the prompt rendering of eval/
        from . import document

        return getattr(document, name)
    if name == "kv_bytes":
        from .budget import kv_bytes

        return kv_bytes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CompressedCache",
    "Document",
    "ExpectedAttentionPolicy",
    "Fp8Cache",
    "Fp8Codec",
    "HeavyHitterCache",
    "HeavyHitterPolicy",
    "IdentityCodec",
    "IntNCodec",
    "KeepAllPolicy",
    "KeyDiffPolicy",
    "KVzipPolicy",
    "RandomPolicy",
    "SnapKVPolicy",
    "TOVAPolicy",
    "compress_document",
    "load_document",
    "prefill",
    "repeat_prompt_ids",
    "QuantizedCache",
    "SinkWindowCache",
    "SinkWindowPolicy",
    "save_cache",
    "load_cache",
    "make_cache",
    "measured_kv_bytes",
    "parse_spec",
    "use_kvcompress_attention",
]
