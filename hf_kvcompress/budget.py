"""KV cache budget calculator: the size formula of lesson 13.1, read from real configs, and the plans built on it.

The formula is 2 x layers x kv_heads x head_dim x bytes x tokens x batch. Every compression family shrinks one factor
(bytes: quantization, tokens: eviction, kv_heads: head sharing, head_dim: low rank), so a plan is the same formula
with one factor changed. This file is pure arithmetic: it reads configs by attribute and imports neither torch nor
transformers, so the lesson's numbers are checked without a model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import cast

GIB = 1024**3
MIB = 1024**2

# The lesson's running example: an 8B-class model serving 8 users with 32k-token chats on an 80 GiB GPU.
LESSON_TOKENS = 32_000
LESSON_USERS = 8
LESSON_GPU_GIB = 80
LESSON_WEIGHTS_GIB = 16

# Bytes per stored value, by the names users type and the names torch and configs print.
_DTYPE_BYTES = {
    "float64": 8, "fp64": 8, "double": 8,
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1,
    "int4": 0.5, "int2": 0.25,
}
_DTYPE_LABELS = {8: "FP64", 4: "FP32", 2: "FP16", 1: "8-bit", 0.5: "INT4", 0.25: "INT2"}

# transformers' layer types, by what a DynamicCache layer of that type keeps per token (see `kv_shape_from_config`).
_FULL_TYPES = ("full_attention", "attention", "hybrid")
_SLIDING_TYPES = ("sliding_attention", "hybrid_sliding")
_CHUNKED_TYPES = ("chunked_attention",)
_NO_KV_TYPES = ("linear_attention", "mamba", "conv", "moe", "mlp", "dummy")


def _positive_int(name: str, value) -> int:
    """`value` as an int, or a ValueError naming the parameter: a count of zero or less has no meaning here."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0 (e.g. 2 for FP16, 1 for INT8, 0.5 for INT4), got {value!r}")
    return cast(float, value)  # any real number, returned as given (an int stays an int)


def _nonnegative_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return cast(float, value)  # any real number, returned as given (an int stays an int)


def _exact(value):
    """An int when the byte count is whole, so 0.5-byte values still give exact integer totals."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def kv_bytes(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float, tokens: int, batch: int = 1):
    """Bytes of a plain KV cache: 2 (one key, one value) x layers x kv_heads x head_dim x bytes x tokens x batch.

    Args:
        layers: decoder layers, each with its own cache.
        kv_heads: key/value heads per layer (fewer than query heads under GQA/MQA).
        head_dim: values per head.
        bytes_per_value: 2 for FP16/BF16, 1 for INT8/FP8, 0.5 for INT4; fractions are fine.
        tokens: tokens held per sequence.
        batch: sequences (users) held at once.

    Returns:
        The byte count, an int whenever it is whole.

    Raises:
        ValueError: a count is not a positive integer or `bytes_per_value` is not > 0.
    """
    named = (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("tokens", tokens), ("batch", batch))
    counts = [_positive_int(name, value) for name, value in named]
    size = _positive_number("bytes_per_value", bytes_per_value)
    return _exact(2 * math.prod(counts) * size)


def dtype_bytes(dtype) -> float:
    """Bytes per value of a dtype given as a torch dtype, a config's dtype string or a short name ("int4", "fp8").

    Raises:
        ValueError: the dtype is not one the calculator knows; the message lists the names it accepts.
    """
    if isinstance(dtype, Real) and not isinstance(dtype, bool):
        return _positive_number("dtype", dtype)
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_BYTES)} or a number of bytes, got {dtype!r}")
    return _DTYPE_BYTES[name]


def dtype_label(bytes_per_value: float | None, dtype=None) -> str:
    """A short upper-case name for a table heading: "FP16", "BF16", "INT4"; the byte size when nothing fits
    (`bytes_per_value` is read only without a `dtype`)."""
    if dtype is not None:
        name = str(dtype).lower().removeprefix("torch.")
        short = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
                 "float64": "fp64", "double": "fp64", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
        return short.get(name, name).upper()
    if bytes_per_value is None:
        raise ValueError("dtype_label needs bytes_per_value or dtype")
    return _DTYPE_LABELS.get(bytes_per_value, f"{bytes_per_value:g}-byte")


# What a model's cache is counted in when no dtype is given: models are served in 16-bit, whatever their config
# says (the embedded models' configs say float32 because their weights were dequantized from GGUF, and a CPU runs
# them in float32), so every ratio is against the 16-bit cache a user would serve.
SERVED_DTYPES = ("bfloat16", "float16")
DEFAULT_SERVED = "bfloat16"


def served_dtype(*dtypes) -> tuple[str, str | None]:
    """The dtype a model is served in: the first 16-bit one of `dtypes` (the dtype it ran in, its config's), else
    bfloat16; and a note saying why when it was assumed rather than given.

    Args:
        dtypes: torch dtypes or names, most specific first (e.g. the model's run dtype, then its config's); None
            entries are skipped.
    """
    names = [str(d).lower().removeprefix("torch.") for d in dtypes if d is not None]
    names = [{"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(n, n) for n in names]
    for name in names:
        if name in SERVED_DTYPES:
            return name, None
    said = f"{names[0]} here" if names else "no dtype given"
    return DEFAULT_SERVED, (f"bytes are counted at {DEFAULT_SERVED}, the dtype models are served in ({said}; "
                            "--dtype to change)")


@dataclass(frozen=True)
class KVShape:
    """The factors of the size formula for one model, plus what each layer really keeps.

    Attributes:
        layers: decoder layers.
        kv_heads: key/value heads per layer. An MLA shape has 1 (one latent shared by all heads).
        head_dim: values per head. An MLA shape holds the latent width here.
        windows: per layer, how many tokens it keeps. None: every token (full attention). An int w >= 1: a
            sliding-window (or chunked) layer, holding at most w tokens (see `tokens_held`). 0: no per-token cache
            (linear attention, a layer that reuses another layer's cache). Empty: every layer is full attention.
        latent_dim: MLA only: values cached per token per layer (kv_lora_rank + qk_rope_head_dim), counted once
            because keys and values are both expanded from that one latent.
        attention_heads: query heads, to tell MHA (kv_heads == attention_heads) from GQA/MQA; None if unknown.
        dtype: the dtype the config declares, None if it declares none.
    """

    layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()
    latent_dim: int | None = None
    attention_heads: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        _positive_int("layers", self.layers)
        _positive_int("kv_heads", self.kv_heads)
        _positive_int("head_dim", self.head_dim)
        if self.latent_dim is not None:
            _positive_int("latent_dim", self.latent_dim)
        if self.attention_heads is not None:
            _positive_int("attention_heads", self.attention_heads)
        object.__setattr__(self, "windows", tuple(self.windows))
        if self.windows and len(self.windows) != self.layers:
            raise ValueError(f"windows must list one entry per layer ({self.layers}), got {len(self.windows)}")
        for window in self.windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, Integral)
                                       or window < 0):
                raise ValueError(f"windows entries must be None (full), 0 (no cache) or an int >= 1, got {window!r}")

    @property
    def values_per_token(self) -> int:
        """Values one token adds to one full-attention layer: K and V per KV head, or the MLA latent once."""
        return self.latent_dim if self.latent_dim is not None else 2 * self.kv_heads * self.head_dim

    @property
    def sliding_layers(self) -> int:
        return sum(1 for window in self.windows if window)

    def tokens_held(self, tokens: int) -> tuple[int, ...]:
        """Tokens whose keys and values each layer keeps in memory between decoding steps, after `tokens` tokens.

        A sliding layer counts min(tokens, window). transformers' DynamicSlidingWindowLayer exposes only the last
        window - 1 tokens (the next query brings the window's last one), but it keeps them as a slice of the
        tensor it concatenated during the step, so the storage it pins while waiting holds `window` rows; a
        StaticCache allocates `window` rows too. Bytes are what this calculator is for, so it counts the storage
        (tests/test_budget.py checks this against `measured_kv_bytes`). Right after a prefill longer than the
        window the whole prompt stays pinned until the first decoding step; that transient is not counted.
        """
        tokens = _positive_int("tokens", tokens)
        windows = self.windows or (None,) * self.layers
        return tuple(tokens if window is None else min(tokens, window) if window else 0 for window in windows)

    def nbytes(self, tokens: int, batch: int = 1, bytes_per_value: float = 2):
        """Bytes held for `batch` sequences of `tokens` tokens; the lesson's formula when every layer is full."""
        batch = _positive_int("batch", batch)
        size = _positive_number("bytes_per_value", bytes_per_value)
        return _exact(sum(self.tokens_held(tokens)) * self.values_per_token * size * batch)


# The lesson's 8B-class model: 32 layers, 32 KV heads (plain multi-head attention), head_dim 128.
LESSON_SHAPE = KVShape(layers=32, kv_heads=32, head_dim=128, attention_heads=32)


def _text_config(config):
    """The decoder config of a (possibly multimodal) config; duck-typed so any object with the attributes works."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def _layer_windows(config, layers: int) -> tuple[int | None, ...]:
    """Per-layer windows (see `KVShape.windows`), following the rules transformers' DynamicCache builds layers by."""
    sliding_window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        # No list: transformers makes every layer sliding when the config has a window (Mistral-7B-v0.1 does).
        kind = "sliding_attention" if sliding_window else "chunked_attention" if chunk else "full_attention"
        layer_types = [kind] * layers
    if len(layer_types) != layers:
        raise ValueError(f"config.layer_types lists {len(layer_types)} layers but num_hidden_layers is {layers}")
    sharing = getattr(config, "kv_sharing_modes", None) or [None] * layers
    windows: list[int | None] = []
    for kind, mode in zip(layer_types, sharing, strict=False):
        if mode == "reuse" or kind in _NO_KV_TYPES:
            windows.append(0)
        elif kind in _FULL_TYPES:
            windows.append(None)
        elif kind in _SLIDING_TYPES + _CHUNKED_TYPES:
            window = sliding_window if kind in _SLIDING_TYPES else chunk
            if not window:
                field = "sliding_window" if kind in _SLIDING_TYPES else "attention_chunk_size"
                raise ValueError(f"config has {kind!r} layers but no {field}")
            windows.append(int(window))
        else:
            known = _FULL_TYPES + _SLIDING_TYPES + _CHUNKED_TYPES + _NO_KV_TYPES
            raise ValueError(f"layer type {kind!r} is not counted by the budget calculator; "
                             f"it knows {', '.join(known)}")
    return tuple(windows)


def kv_shape_from_config(config) -> KVShape:
    """Read a model's KV shape from any transformers config (or an object with the same attribute names).

    Follows what transformers itself caches: `num_key_value_heads` (GQA/MQA; default `num_attention_heads`),
    an explicit `head_dim` when set (Gemma's differs from hidden_size // heads), `layer_types` plus
    `sliding_window` / `attention_chunk_size` for models that mix full and windowed layers, and for MLA
    (DeepSeek-V2/V3: `kv_lora_rank` and `qk_rope_head_dim`) the latent of kv_lora_rank + qk_rope_head_dim values
    per token per layer, which is what the cache stores instead of per-head keys and values.

    Raises:
        ValueError: the config lacks a field the formula needs, or has a layer type it cannot count.
    """
    text = _text_config(config)

    def need(name):
        value = getattr(text, name, None)
        if value is None:
            raise ValueError(f"config has no {name}; the KV shape needs it")
        return value

    layers = _positive_int("num_hidden_layers", need("num_hidden_layers"))
    heads = _positive_int("num_attention_heads", need("num_attention_heads"))
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    windows = _layer_windows(text, layers)
    windows = () if all(window is None for window in windows) else windows
    if getattr(text, "kv_lora_rank", None) is not None:
        rope = _positive_int("qk_rope_head_dim", need("qk_rope_head_dim"))
        latent = _positive_int("kv_lora_rank", text.kv_lora_rank) + rope
        return KVShape(layers, 1, latent, windows, latent_dim=latent, attention_heads=heads, dtype=dtype)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or need("hidden_size") // heads
    return KVShape(layers, _positive_int("num_key_value_heads", kv_heads), _positive_int("head_dim", head_dim),
                   windows, attention_heads=heads, dtype=dtype)


def kv_bytes_from_config(config, tokens: int, batch: int = 1, bytes_per_value: float | None = None):
    """Bytes a model's cache holds for `batch` sequences of `tokens` tokens (sliding layers: `KVShape.tokens_held`).

    Args:
        config: any transformers config (multimodal ones are read through their text config).
        tokens: tokens per sequence.
        batch: sequences held at once.
        bytes_per_value: bytes per stored value; None takes the config's dtype, and 2 (16-bit, as the lesson
            assumes) when the config declares none.
    """
    shape = kv_shape_from_config(config)
    if bytes_per_value is None:
        bytes_per_value = dtype_bytes(shape.dtype) if shape.dtype else 2
    return shape.nbytes(tokens, batch, bytes_per_value)


def weight_bytes(n_params: int, dtype) -> int | float:
    """Bytes of `n_params` weights stored as `dtype` (a torch dtype, a name such as "bfloat16", or bytes per value)."""
    return _exact(_positive_int("n_params", n_params) * dtype_bytes(dtype))


def model_weight_bytes(model) -> int:
    """Bytes of a model's parameters as stored (tied weights once); works on a model built on the meta device."""
    return sum(param.numel() * param.element_size() for param in model.parameters())


@dataclass(frozen=True)
class CapacityPlan:
    """How many users' caches fit next to the weights on one GPU.

    Attributes:
        free_bytes: memory left for caches: GPU memory - weights - reserve.
        cache_bytes_per_user: one user's cache at the planned context.
        users: whole users that fit, rounded down: half a cache serves nobody.
    """

    # Bytes as given (ints, or floats such as 80e9) and what follows from them.
    gpu_memory_bytes: int | float
    weights_bytes: int | float
    reserve_bytes: int | float
    context_tokens: int
    free_bytes: int | float
    cache_bytes_per_user: int | float
    users: int


def _planned_shape(shape: KVShape, kv_heads: int | None, head_dim: int | None) -> KVShape:
    if kv_heads is None and head_dim is None:
        return shape
    if shape.latent_dim is not None:
        raise ValueError("kv_heads and head_dim cannot change an MLA shape: its cache is one shared latent")
    return dataclasses.replace(shape, kv_heads=kv_heads or shape.kv_heads, head_dim=head_dim or shape.head_dim)


def _capacity(gpu_memory_bytes, weights_bytes, context_tokens, shape, bytes_per_value=2, kv_heads=None,
              kept_tokens=None, head_dim=None, reserve_bytes=0) -> CapacityPlan:
    """`plan_capacity` without the check that someone fits, so tables can show a 0."""
    gpu = _positive_number("gpu_memory_bytes", gpu_memory_bytes)
    weights_bytes = _nonnegative_number("weights_bytes", weights_bytes)
    reserve_bytes = _nonnegative_number("reserve_bytes", reserve_bytes)
    context = _positive_int("context_tokens", context_tokens)
    held = context if kept_tokens is None else min(context, _positive_int("kept_tokens", kept_tokens))
    per_user = _planned_shape(shape, kv_heads, head_dim).nbytes(held, 1, bytes_per_value)
    free = gpu - weights_bytes - reserve_bytes
    users = max(0, math.floor(free / per_user))
    return CapacityPlan(gpu, weights_bytes, reserve_bytes, context, free, per_user, users)


def plan_capacity(gpu_memory_bytes, weights_bytes, context_tokens: int, shape: KVShape = LESSON_SHAPE,
                  bytes_per_value: float = 2, kv_heads: int | None = None, kept_tokens: int | None = None,
                  head_dim: int | None = None, reserve_bytes=0) -> CapacityPlan:
    """The lesson's worked example turned around: how many users fit, given the GPU we already have.

    users = floor((GPU memory - weights - reserve) / cache per user). The optional arguments apply one plan:
    `kv_heads` (share heads), `kept_tokens` (evict down to a budget), `head_dim` (low rank), `bytes_per_value`
    (quantize).

    Raises:
        ValueError: an argument is out of range, or not even one user's cache fits (the message gives the numbers).
    """
    plan = _capacity(gpu_memory_bytes, weights_bytes, context_tokens, shape, bytes_per_value, kv_heads,
                     kept_tokens, head_dim, reserve_bytes)
    if plan.users < 1:
        raise ValueError(
            f"not even one user fits: one {plan.context_tokens:,}-token cache needs "
            f"{plan.cache_bytes_per_user / GIB:.2f} GiB but only {max(plan.free_bytes, 0) / GIB:.2f} GiB is free "
            f"({plan.gpu_memory_bytes / GIB:g} GiB GPU - "
            f"{plan.weights_bytes / GIB:g} GiB weights - {plan.reserve_bytes / GIB:g} GiB reserve)")
    return plan


@dataclass(frozen=True)
class PlanRow:
    """One line of the lesson's table: a plan's name, its bytes and how many times smaller than the baseline."""

    name: str
    nbytes: int | float
    factor: float


@dataclass(frozen=True)
class PlanTable:
    """The lesson's table for one shape, with notes on plans left out (a model may already share heads)."""

    shape: KVShape
    tokens: int
    users: int
    bytes_per_value: float
    label: str
    per_token_bytes: int | float
    rows: tuple[PlanRow, ...]
    notes: tuple[str, ...] = ()


def _shared_heads(shape: KVShape) -> int | None:
    """KV heads for the head-sharing plan: a quarter of the model's (lesson: 32 -> 8); None when already minimal."""
    if shape.latent_dim is not None or shape.kv_heads == 1:
        return None
    return max(1, shape.kv_heads // 4)


def _heads_text(kv_heads: int) -> str:
    return f"{kv_heads} KV head{'s' if kv_heads != 1 else ''}"


def _sharing_name(kv_heads: int) -> str:
    return "MQA 1 KV" if kv_heads == 1 else f"GQA {kv_heads} KV"


def _tokens_name(tokens: int) -> str:
    return f"{tokens // 1000}k" if tokens >= 1000 and tokens % 1000 == 0 else f"{tokens:,}"


def compression_plans(shape: KVShape = LESSON_SHAPE, tokens: int = LESSON_TOKENS, users: int = LESSON_USERS,
                      bytes_per_value: float = 2, kept_tokens: int | None = None,
                      label: str | None = None) -> PlanTable:
    """The lesson's table of plans for any shape: each compression family applied alone, plus GQA + INT8.

    For the lesson's shape the rows are the lesson's: GQA to 8 KV heads (a quarter), eviction to 4k tokens (an
    eighth of the context), low rank 128 -> 32 (a quarter). Other shapes get the same fractions. A plan that cannot
    apply is left out with a note: head sharing for an MQA or MLA model, low rank for MLA (its cache is already a
    low-rank latent).

    Args:
        kept_tokens: tokens the eviction plan keeps; None keeps tokens // 8, the lesson's 4k of 32k.
        label: the baseline's dtype name; None derives it from `bytes_per_value` ("FP16" for 2).
    """
    tokens, users = _positive_int("tokens", tokens), _positive_int("users", users)
    kept = max(1, tokens // 8) if kept_tokens is None else _positive_int("kept_tokens", kept_tokens)
    label = label or dtype_label(bytes_per_value)
    base = shape.nbytes(tokens, users, bytes_per_value)
    plans = [(f"baseline {label}", base),
             ("quantize to INT8", shape.nbytes(tokens, users, 1)),
             ("quantize to INT4", shape.nbytes(tokens, users, 0.5)),
             (f"evict: keep {_tokens_name(kept)} tokens", shape.nbytes(min(kept, tokens), users, bytes_per_value))]
    notes = []
    if shape.attention_heads and 1 < shape.kv_heads < shape.attention_heads and shape.latent_dim is None:
        notes.append(f"already GQA: {shape.kv_heads} KV heads for {shape.attention_heads} query heads")
    shared = _shared_heads(shape)
    if shared is not None:
        plans.append((f"share heads: {_sharing_name(shared)}",
                      dataclasses.replace(shape, kv_heads=shared).nbytes(tokens, users, bytes_per_value)))
    elif shape.latent_dim is None:
        notes.append("share heads: skipped, already MQA (1 KV head)")
    if shape.latent_dim is None:
        rank = max(1, shape.head_dim // 4)
        plans.append((f"low-rank: {shape.head_dim} -> {rank} dims",
                      dataclasses.replace(shape, head_dim=rank).nbytes(tokens, users, bytes_per_value)))
    else:
        notes.append(f"share heads, low-rank: skipped, already MLA "
                     f"({shape.latent_dim} latent values per token per layer)")
    if shared is not None:
        plans.append((f"{_sharing_name(shared).removesuffix(' KV')} + INT8 combined",
                      dataclasses.replace(shape, kv_heads=shared).nbytes(tokens, users, 1)))
    if shape.sliding_layers:
        windows = sorted({window for window in shape.windows if window})
        notes.append(f"{shape.sliding_layers} of {shape.layers} layers use a "
                     f"{'/'.join(map(str, windows))}-token window: "
                     f"they hold at most that many tokens, whatever the context")
    rows = tuple(PlanRow(name, nbytes, base / nbytes) for name, nbytes in plans)
    per_token = shape.nbytes(1, 1, bytes_per_value)
    return PlanTable(shape, tokens, users, bytes_per_value, label, per_token, rows, tuple(notes))


def format_plans(table: PlanTable) -> str:
    """The table as the lesson prints it (GB there means GiB, 1024**3, as in the lesson's code)."""
    per_token = table.per_token_bytes / 1024
    per_token_text = f"{per_token:.0f}" if float(per_token).is_integer() else f"{per_token:.1f}"
    big = table.rows[0].nbytes >= GIB
    unit, scale = ("GB", GIB) if big else ("MB", MIB)
    lines = [f"KV bytes per token ({table.label}): {per_token_text} KiB"]
    lines += [f"{row.name:26s} {row.nbytes / scale:6.1f} {unit}  ({row.factor:4.1f}x smaller)" for row in table.rows]
    lines += [f"note: {note}" for note in table.notes]
    return "\n".join(lines)


def capacity_plans(shape: KVShape = LESSON_SHAPE, gpu_memory_bytes=LESSON_GPU_GIB * GIB,
                   weights_bytes=LESSON_WEIGHTS_GIB * GIB, context_tokens: int = LESSON_TOKENS,
                   bytes_per_value: float = 2, reserve_bytes=0, label: str | None = None
                   ) -> tuple[tuple[str, CapacityPlan], ...]:
    """The worked example's three steps: the model as is, with shared heads, and shared heads with 1-byte values.

    For the lesson these are 4, 16 and 32 users on an 80 GiB GPU with 16 GiB of weights. A step that does not
    apply (head sharing for MQA or MLA) is left out; a step where nobody fits shows 0 users rather than raising.
    """
    label = label or dtype_label(bytes_per_value)
    args = (gpu_memory_bytes, weights_bytes, context_tokens, shape)
    mha = "full MHA" if shape.attention_heads == shape.kv_heads and shape.latent_dim is None else "as is"
    head_text = "MLA latent" if shape.latent_dim is not None else _heads_text(shape.kv_heads)
    plans = [(f"{mha}: {head_text}, {label}", _capacity(*args, bytes_per_value, reserve_bytes=reserve_bytes))]
    shared = _shared_heads(shape)
    if shared is not None:
        name = _sharing_name(shared)
        plans.append((f"{name}, {label}",
                      _capacity(*args, bytes_per_value, kv_heads=shared, reserve_bytes=reserve_bytes)))
        plans.append((f"{name} + 1-byte values", _capacity(*args, 1, kv_heads=shared, reserve_bytes=reserve_bytes)))
    else:
        plans.append((f"{head_text}, 1-byte values", _capacity(*args, 1, reserve_bytes=reserve_bytes)))
    return tuple(plans)


def _gib(nbytes) -> str:
    """GiB with three significant digits, whole GiB past 1000 (no exponent notation in a table)."""
    value = nbytes / GIB
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def format_capacity(plans: tuple[tuple[str, CapacityPlan], ...]) -> str:
    """The worked example as text: free memory, then each plan's cache per user and the users that fit."""
    first = plans[0][1]
    reserve = f" - {_gib(first.reserve_bytes)} GiB reserve" if first.reserve_bytes else ""
    lines = [f"Users that fit: {_gib(first.gpu_memory_bytes)} GiB GPU - {_gib(first.weights_bytes)} GiB weights"
             f"{reserve} = {_gib(first.free_bytes)} GiB for caches, {first.context_tokens:,} tokens per user"]
    for name, plan in plans:
        fits = f"{plan.users:3d} users" if plan.users else "  0 users (does not fit)"
        lines.append(f"{name:32s} {_gib(plan.cache_bytes_per_user):>8s} GiB per user -> {fits}")
    return "\n".join(lines)
