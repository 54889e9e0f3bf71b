"""The named caches users ask for: each one policy x one codec, nothing more."""

from __future__ import annotations

from ..codecs.base import Codec
from ..codecs.fp8 import Fp8Codec
from ..codecs.intn import PLAIN_NAME_DEFAULTS, IntNCodec
from ..ops.bitpack import PACKABLE_BITS
from ..policies.heavy_hitter import HeavyHitterPolicy
from ..policies.sink_window import SinkWindowPolicy
from .compressed import CompressedCache


class QuantizedCache(CompressedCache):
    """Every token kept, stored as KIVI-style int8/int4/int3/int2 (keys per channel, values per token), with the
    options the registry's plain name `int{bits}` carries (rotation, full-precision sinks; at 2 bits also Lloyd-Max
    levels and pre-RoPE keys, which read the RoPE frequencies from `config`, so bits=2 needs it)."""

    def __init__(self, bits: int = 4, group_size: int = 32, residual_length: int = 128, config=None):
        if bits not in PLAIN_NAME_DEFAULTS:
            raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
        # what the registry's `int{bits}` means, with this group size and residual
        options = {**PLAIN_NAME_DEFAULTS[bits], "group_size": group_size, "residual_length": residual_length}
        codec = IntNCodec(bits=bits, **options)
        super().__init__(codec=codec, config=config)


class Fp8Cache(CompressedCache):
    """Every token kept, stored as float8_e4m3fn with a scale per token and head."""

    def __init__(self, config=None):
        super().__init__(codec=Fp8Codec(), config=config)


class SinkWindowCache(CompressedCache):
    """StreamingLLM: the first `sink_tokens` and the last `window` tokens; memory bounded for ever."""

    def __init__(
        self, sink_tokens: int = 4, window: int = 1024, codec: Codec | None = None, config=None, rerotate: bool = False
    ):
        super().__init__(SinkWindowPolicy(sink_tokens=sink_tokens, window=window), codec, config, rerotate)


class HeavyHitterCache(CompressedCache):
    """H2O: the `recent` newest tokens plus the most-attended ones, `budget` tokens per KV head in all.

    Needs attention statistics: built with `config=model.config` (or on a model from `load_model`), the cache
    switches a model running SDPA to 'kvcompress_sdpa' itself; other attention implementations need
    `hf_kvcompress.use_kvcompress_attention(model)`.
    """

    def __init__(self, budget: int = 512, recent: int = 64, sink_tokens: int = 0, codec: Codec | None = None,
                 config=None):
        super().__init__(HeavyHitterPolicy(budget=budget, recent=recent, sink_tokens=sink_tokens), codec, config)
