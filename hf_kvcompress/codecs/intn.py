"""Asymmetric integer quantization of keys and values, KIVI-style (arXiv:2402.02750), truly bit-packed."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

import torch

from ..calibration import key_scales_file, load_key_scales
from ..hf.compat import text_config
from ..hf.rope import rope_inv_freq
from ..ops.bitpack import PACKABLE_BITS, pack, unpack, values_per_unit
from ..ops.cpu_decode import AffineCodes, KernelLayout
from ..ops.hadamard import MATRIX_TOKENS, random_signs, rotate_batch_rows, rotate_rows, rotation_matrix
from ..ops.rerotate import rerotate, rope_table, turn
from ..spec_text import changed_fields, join_spec
from . import plane_attention
from .base import Codec, Encoded, Kind
from .gaussian_levels import levels_tensor, lloyd_max_levels, thresholds_tensor

KEY_AXES = ("channel", "token")
KEY_SCALES = ("none", "auto", "calibrated")  # or a path to a key-scales file (or a directory holding one)
ROTATIONS = ("none", "hadamard", "per_token", "auto")
CODEBOOKS = ("uniform", "gaussian")
_TINY = torch.finfo(torch.bfloat16).tiny
# What the plain names int4/int3/int2 mean: the best configuration measured at that width (docs/results.md,
# "Quantization options"): the rotation measured best for the model's family (`auto`) + 4 full-precision sinks +
# per-channel keys.
# `rotate=none,sink_tokens=0` is plain KIVI.
BEST_LOW_BIT: dict[str, Any] = {"rotate": "auto", "sink_tokens": 4}
# What `rotate=auto` (the plain names) means per model family: measured, not derived (docs/results.md, "Rotating
# keys"). On Gemma-3 rotating per-channel keys raised the attention error at 2, 3 and 4 bits and cost 2-bit answers
# on the suite; on SmolLM2 (Llama) it lowered them. Families not listed rotate everything, as QuaRot does.
ROTATION_BY_MODEL_TYPE: dict[str | None, str] = {"gemma3_text": "per_token", "gemma3": "per_token"}
# The families whose keys `key_scale=auto` scales (where the model ships scales): measured, not derived
# (docs/results.md, "Key channel scales for per-token keys"). On Gemma-3 the global layers' key channels differ
# ~25-fold in spread and the scales brought per-token keys' attention error near per-channel groups'; on SmolLM2
# (~4-fold, Hadamard-rotated) they raised it (0.037 -> 0.051 on the dev prompts).
KEY_SCALE_MODEL_TYPES = frozenset({"gemma3_text", "gemma3"})
# Key scales were measured at 4 bits only: int4 means `key_scale=auto`, int3 and int2 `none` until measured (int2's
# per-token keys use the Gaussian levels, which set their own spread per group).
BEST_FOUR_BIT: dict[str, Any] = {**BEST_LOW_BIT, "key_scale": "auto"}
# At 2 bits the attention error is far above int3's: Lloyd-Max levels for the head_dim groups and pre-RoPE keys lower
# it for no bytes; more sinks lowered it further but kept no more answers for their bytes, so int2 keeps 4
# (docs/results.md, "Quantization options").
BEST_TWO_BIT: dict[str, Any] = {**BEST_LOW_BIT, "codebook": "gaussian", "pre_rope": True}
PLAIN_NAME_DEFAULTS: dict[int, dict[str, Any]] = {2: BEST_TWO_BIT, 3: BEST_LOW_BIT, 4: BEST_FOUR_BIT, 8: {}}


class KeyScales:
    """Key channel scales shared by every cache of the model like its weights: [layers, H_kv, D] (the model's) or
    [H_kv, D] (one layer's), float32.

    No `__dict__`: `measured_kv_bytes` counts what each user's cache holds, and these are per model, not per user
    (`IntNCodec.model_bytes` counts them, once per model), as lowrank's bases (`LayerBases`).
    """

    __slots__ = ("tensor",)
    tensor: torch.Tensor

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def on(self, device: torch.device) -> torch.Tensor:
        """The scales on `device`, moved there once: a layer's holder belongs to one cache (`for_layer`), so the
        decode step reads them without a host-to-device copy per layer and step."""
        if self.tensor.device != device:
            self.tensor = self.tensor.to(device)
        return self.tensor


@lru_cache(maxsize=64)
def _offset_turns(inv_freq: tuple[float, ...], group: int, direction: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_table` [group, 2 * len(inv_freq)] of turning by `direction` x offset positions (offsets 0..group-1),
    on `device`: pre_rope's offset queries need the same table at every decode step of every layer, and building it
    (arange, cos, sin, cat) cost about as much as turning the queries; kept per device, as a copy from the host per
    step blocks a GPU."""
    if torch.device(device).type != "cpu":
        cos, sin = _offset_turns(inv_freq, group, direction)
        return cos.to(device), sin.to(device)
    offsets = torch.arange(group, dtype=torch.float32) * direction
    return rope_table(offsets, torch.tensor(inv_freq, dtype=torch.float32))


@lru_cache(maxsize=64)
def _offset_turn_table(inv_freq: tuple[float, ...], group: int, device: torch.device) -> torch.Tensor:
    """`_offset_turns(inv_freq, group, -1)` stacked [2, group, rot] (cos, sin), as the decode kernel reads it."""
    return torch.stack(_offset_turns(inv_freq, group, -1, device))


def _layer_list(text) -> tuple[int, ...]:
    """"7/18/23" (or a single int, as specs parse "7") -> (7, 18, 23), sorted; anything else is refused."""
    parts = [text] if isinstance(text, int) else str(text).split("/") if str(text) else []
    try:
        layers = sorted({int(p) for p in parts})
    except ValueError:
        layers = [-1]
    if any(layer < 0 for layer in layers) or isinstance(text, bool):
        raise ValueError(f"wide_layers must be layer indices >= 0 separated by '/', e.g. 7/18/23, got {text!r}")
    return tuple(layers)


def _bf16_directed(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> bfloat16 rounded towards +inf (`up`) or -inf, exactly: bf16 is the top half of a float32."""
    bits = x.float().contiguous().view(torch.int32)
    chopped = bits & -65536  # drop the low 16 bits: rounds towards zero
    inexact = (bits & 0xFFFF) != 0
    # Towards zero is the wanted direction for positive values rounding down and negative values rounding up;
    # otherwise step one bf16 ulp away from zero.
    away = inexact & ((bits < 0) != up)
    return (chopped + away.to(torch.int32) * 65536).view(torch.float32).to(torch.bfloat16)


def _quantize(x: torch.Tensor, bits: int, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max asymmetric quantization over `reduce_dim`; scale and zero point stored in bfloat16.

    bfloat16 has float32's range, so a value of 7e4 or 1e-5 neither overflows nor vanishes (fp16 did both). The zero
    point is rounded down and the scale up, so the stored grid still covers [min, max]: nothing is clamped and every
    value decodes within half a (stored) step.
    """
    levels = (1 << bits) - 1
    x = x.float()
    low, hi = torch.aminmax(x, dim=reduce_dim, keepdim=True)  # one pass, the same values as amin and amax
    lo = _bf16_directed(low, up=False)
    scale = _bf16_directed(((hi - lo.float()) / levels).clamp(min=_TINY), up=True)
    codes = ((x - lo.float()) / scale.float()).round().clamp(0, levels)
    return codes, scale, lo


def _quantize_gaussian(x: torch.Tensor, bits: int, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd-Max levels of N(0, 1) placed at the group's mean (zero) plus multiples of its standard deviation (scale).

    Both are stored in bfloat16 and the codes are chosen against the stored (rounded) numbers, so decoding
    reproduces exactly the level the encoder picked. Values beyond the outer levels are clipped to them: that is
    where the lower mean squared error comes from.
    """
    x = x.float()
    mean = x.mean(dim=reduce_dim, keepdim=True).to(torch.bfloat16)
    std = (x - mean.float()).pow(2).mean(dim=reduce_dim, keepdim=True).sqrt()
    scale = std.clamp(min=_TINY).to(torch.bfloat16).clamp(min=_TINY)
    normalized = (x - mean.float()) / scale.float()
    return _bucket(normalized, thresholds_tensor(bits, x.device)), scale, mean


def _bucket(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """`torch.bucketize(x, edges)` as uint8: how many edges lie strictly below each value. One comparison per
    edge (3 at 2 bits) instead of a binary search per value: 0.4 ms instead of 2.9 ms for a layer's 896 prompt
    values on one CPU thread, where the rest of int2's value encoding costs about as much (docs/speed.md)."""
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for edge in edges:  # float32 0-d tensors: compared in float32, as bucketize compares
        codes += x > edge
    return codes


@dataclass(frozen=True)
class IntNCodec(Codec):
    """int8 / int4 / int3 / int2 with a scale and zero point per group of `group_size` values.

    Values are quantized per token (groups along the channels). Keys, whose outliers sit in fixed channels, are
    quantized per channel with groups of `group_size` tokens (KIVI) when `key_axis="channel"`; such a group can only
    be encoded once it is full and cannot lose single tokens, so evicting policies need `key_axis="token"`.
    `residual_length` recent tokens stay at full precision; older ones are encoded once, a group at a time, and
    never re-quantized. Per-channel groups run over token slots shared by a batch, so a left-padded row equals the
    row alone only when its padding is a whole number of groups (the cache warns otherwise).

    Args:
        bits: 2, 3, 4 or 8 bits per value (3 bits pack 8 values into 3 bytes).
        group_size: values sharing one bfloat16 scale and zero point, for keys and values alike unless
            `key_group_size` / `value_group_size` say otherwise; must divide head_dim.
        key_group_size: tokens per per-channel key group (key_axis="channel", KIVI) where it differs from
            `group_size` (None: `group_size`). Such a group runs along tokens, so its length costs the widths
            nothing (a lowrank stack's ranks follow the value groups) and only delays when a group is encoded (the
            residual holds the unfinished one). Keys grouped per token (key_axis="token": evicting policies) keep
            `group_size` channels a group, so a stack's default of per-channel key groups (`lowrank:ratio=0.5+int4`)
            leaves an evicting policy's keys as they were.
        value_group_size: channels per value group (values are grouped per token) where it differs from
            `group_size` (None: `group_size`).
        residual_length: recent tokens kept at full precision.
        key_axis: "channel" (KIVI) or "token"; None picks "channel" without eviction and "token" with it.
        rotate: "hadamard" multiplies each head vector by a Hadamard matrix with random signs before quantizing
            (QuaRot, arXiv:2404.00456) and undoes it after decoding; signs are fixed per decoder layer and per
            keys/values. "per_token" rotates only the groups that run along head_dim (values, and keys stored
            per token, as evicting policies store them), where the rotation makes a
            vector's coordinates alike, and leaves per-channel key groups their own channels' scales: on Gemma-3,
            whose global layers' key channels differ widely in spread (the widest ~23 times the median, ~2 on
            SmolLM2), rotating per-channel keys raised their attention error at every width, while on SmolLM2 it
            lowered it (docs/results.md, "Rotating keys"). "auto" (the plain names) picks per model family from
            measurements (ROTATION_BY_MODEL_TYPE; "hadamard" for families not measured or without a config). "none"
            quantizes the raw vectors.
        sink_tokens: the first real tokens of each row (padding excluded) that the cache keeps at full precision
            (attention sinks, IntactKV arXiv:2403.01241).
        codebook: "uniform" spreads 2**bits levels evenly from each group's minimum to its maximum. "gaussian"
            uses the Lloyd-Max levels of a normal variable around the group's mean in units of its standard
            deviation (`gaussian_levels.py`) for the groups that run along head_dim (values, and keys with
            key_axis="token"): after the rotation the coordinates of one vector are close to Gaussian, but one
            channel's run of tokens is not, so per-channel key groups keep the min/max grid (measured: the Gaussian
            levels raised the per-channel key error). Same bytes either way.
        pre_rope: quantize per-channel key groups as if before RoPE (KVQuant, arXiv:2401.18079): each key is
            rotated back by its offset from its group's first token, so the whole group shares one RoPE rotation
            and a channel's values no longer spin with position inside the group; decoding rotates them forward
            again. Offsets within a group are all it needs (never absolute positions), read with the RoPE
            frequencies from the model's config, so the cache must be built with it (`make_cache(spec, config)`).
            Keys grouped per token (key_axis="token", evicting policies) are left as they are.
        wide_layers: decoder layers (e.g. "7/18/23") stored at `wide_bits` instead of `bits`: per-layer mixed
            precision (KVTuner, arXiv:2502.04420). Some layers' attention suffers far more from 2 bits than others
            (on SmolLM2 six of 30 layers carry 40% of the error);
            `benchmarks/probes/quant_attention_error.py --per-layer` lists each layer's error for a model. Their
            bytes are counted at their own width.
        wide_bits: the width of `wide_layers` (4).
        key_scale: divide each key channel by a per-model, per-layer, per-KV-head scale before keys grouped per
            token (key_axis="token": evicting policies) are rotated and quantized, and multiply it back when they are
            read (SmoothQuant arXiv:2211.10438 / KVQuant arXiv:2401.18079 for per-token groups). A per-token group
            shares one grid across its channels, so a few wide channels (Gemma-3's global layers) set a step too
            coarse for all the others; per-channel groups (KIVI) have their own scales and are left as they are.
            Attention reads the scaled keys with the query multiplied by the scale (q . k = (s q) . (k / s)), so
            the kernels read them unchanged. "calibrated": the scales shipped for the model (`hf-kvcompress
            calibrate --key-scales` writes them for others); a path: that file, or a directory holding one; "auto"
            (the plain name int4): "calibrated" for the families where the scales were measured to
            help (KEY_SCALE_MODEL_TYPES: Gemma-3) when the model ships a file, "none" otherwise; "none": no scale.
            The scales (float32, layers x KV heads x head_dim) are held once per model, not per cache:
            `model_bytes` counts them, `measured_kv_bytes` does not.
    """

    bits: int = 4
    group_size: int = 32
    key_group_size: int | None = None
    value_group_size: int | None = None
    residual_length: int = 128  # type: ignore[misc]  # a field here; the base's class default serves codecs without one
    key_axis: Literal["channel", "token"] | None = field(default=None)
    rotate: Literal["none", "hadamard", "per_token", "auto"] = "none"
    sink_tokens: int = 0  # type: ignore[misc]  # a field here; the base's class default serves codecs without one
    codebook: Literal["uniform", "gaussian"] = "uniform"
    pre_rope: bool = False
    wide_layers: str = ""
    wide_bits: int = 4
    key_scale: str = "none"
    # RoPE inverse frequencies of the full-attention layers, filled in by `for_model` when pre_rope is on.
    inv_freq: tuple[float, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # What `rotate=auto` means for the model this copy serves, set by `for_model` ("" until then: hadamard).
    settled_rotation: str = field(default="", init=False, repr=False, compare=False)
    # Whether `key_axis` was settled by `for_policy` from None (the policy's choice, which the spec leaves to the
    # policy) rather than given: a given axis is part of the spec, as it changes what is stored.
    axis_settled: bool = field(default=False, init=False, repr=False, compare=False)
    # The decoder layer this copy serves (see `for_layer`): it seeds the rotation's signs.
    layer: int = field(default=0, init=False, repr=False)
    # The key channel scales: every layer's [layers, H_kv, D], set by `for_model` (key_scale), then this layer's
    # [H_kv, D] by `for_layer`; None: keys are not scaled.
    model_key_scales: KeyScales | None = field(default=None, init=False, repr=False, compare=False)
    layer_key_scale: KeyScales | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.bits not in PACKABLE_BITS:
            raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")
        for name in ("key_group_size", "value_group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or none (group_size's), got {value!r}")
        if not isinstance(self.residual_length, int) or self.residual_length < 0:
            raise ValueError(f"residual_length must be an integer >= 0, got {self.residual_length!r}")
        if self.key_axis is not None and self.key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES} or None, got {self.key_axis!r}")
        if self.rotate is None:  # specs parse "rotate=none" to None
            object.__setattr__(self, "rotate", "none")
        if self.rotate not in ROTATIONS:
            raise ValueError(f"rotate must be one of {ROTATIONS}, got {self.rotate!r}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if self.codebook not in CODEBOOKS:
            raise ValueError(f"codebook must be one of {CODEBOOKS}, got {self.codebook!r}")
        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"pre_rope must be true or false, got {self.pre_rope!r}")
        if self.wide_bits not in PACKABLE_BITS:
            raise ValueError(f"wide_bits must be one of {PACKABLE_BITS}, got {self.wide_bits!r}")
        object.__setattr__(self, "wide_layers", "/".join(map(str, _layer_list(self.wide_layers))))
        if self.key_scale is None:  # specs parse "key_scale=none" to None
            object.__setattr__(self, "key_scale", "none")
        if not isinstance(self.key_scale, str) or not self.key_scale:
            raise ValueError(f"key_scale must be one of {KEY_SCALES} or a path to a key-scales file, "
                             f"got {self.key_scale!r}")

    @property
    def widened(self) -> tuple[int, ...]:
        """The decoder layers stored at `wide_bits`."""
        return _layer_list(self.wide_layers)

    @property
    def needs_model(self) -> bool:
        """pre_rope reads the model's config (its RoPE frequencies); wide_layers checks its layer count; key_scale
        (other than none/auto) reads the model's calibration."""
        return self.pre_rope or bool(self.wide_layers) or self.key_scale not in ("none", "auto")

    def for_model(self, config) -> IntNCodec:
        """Settle `rotate=auto` for the model's family, and read the full-attention layers' RoPE frequencies from
        the config (pre_rope only). A model without RoPE stores its keys unrotated already, so pre_rope has nothing
        to undo there (no frequencies, no change)."""
        codec = self
        if codec.rotate == "auto":  # the spec keeps saying `auto`; the copy knows what it means for this model
            codec = copy.copy(codec)
            model_type = getattr(text_config(config), "model_type", None)
            object.__setattr__(codec, "settled_rotation", ROTATION_BY_MODEL_TYPE.get(model_type, "hadamard"))
        if codec.key_scale != "none":
            codec = codec._with_model_key_scales(config)
        if codec.widened:
            layers = text_config(config).num_hidden_layers
            if codec.widened[-1] >= layers:
                raise ValueError(f"wide_layers must be decoder layers 0 to {layers - 1} of this model, "
                                 f"got {codec.wide_layers!r}")
        if not codec.pre_rope:
            return codec
        has_rope = getattr(text_config(config), "rope_parameters", None) is not None
        bound = copy.copy(codec)
        inv_freq = tuple(rope_inv_freq(config, "full_attention").tolist()) if has_rope else ()
        object.__setattr__(bound, "inv_freq", inv_freq)
        return bound

    def _with_model_key_scales(self, config) -> IntNCodec:
        """A copy holding the model's key scales (`key_scale`), or self where `auto` finds none for the model."""
        named = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
        family = getattr(text_config(config), "model_type", None)
        if self.key_scale == "auto" and (not named or family not in KEY_SCALE_MODEL_TYPES):
            return self
        source = None if self.key_scale in ("auto", "calibrated") else self.key_scale
        path = key_scales_file(source, config)
        if path is None:
            if self.key_scale == "auto":
                return self
            raise ValueError("key_scale=calibrated: no key scales are shipped for this model; write them with "
                             "`hf-kvcompress calibrate --key-scales --model M --out DIR` and pass key_scale=DIR")
        scales = load_key_scales(path, config)
        bound = copy.copy(self)
        object.__setattr__(bound, "model_key_scales", KeyScales(scales))
        return bound

    def for_reduced_states(self) -> IntNCodec:
        """As the storage of a stack (`shared_heads+int4`) the states are not the model's key vectors, so the model's
        key scales do not fit them: `auto` stores them unscaled, an explicit key_scale is refused."""
        if self.key_scale == "none" or self.model_key_scales is None and self.key_scale == "auto":
            return self
        if self.key_scale != "auto":
            raise ValueError(f"key_scale must be none or auto for a codec stored after another (its states are not "
                             f"the model's keys), got {self.key_scale!r}")
        bound = copy.copy(self)
        object.__setattr__(bound, "model_key_scales", None)
        return bound

    def model_bytes(self) -> int:
        """Bytes of the key scales every cache of the model reads (float32 as held), counted once per model, not
        per cache: `measured_kv_bytes` does not count them. 0 without scales."""
        return 0 if self.model_key_scales is None else self.model_key_scales.tensor.numel() * 4

    def _group_rope(self, keys: torch.Tensor, direction: int) -> torch.Tensor:
        """Rotate per-channel key groups [B, H, T, D] by `direction` x (offset within the group) positions."""
        if self.inv_freq is None:
            raise ValueError("pre_rope needs the model's config for its RoPE frequencies: build the cache with "
                             "make_cache(spec, model.config) or CompressedCache(..., config=model.config)")
        if not self.inv_freq:
            return keys
        b, h, t, d = keys.shape
        g = self.group("key")
        offsets = torch.arange(g, device=keys.device, dtype=torch.float32) * direction  # [g], broadcast over groups
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32)
        return rerotate(keys.float().reshape(b, h, t // g, g, d), offsets, inv_freq).reshape(b, h, t, d)

    def spec(self) -> str:
        """`int{bits}` and the fields that differ from what that plain name means (see PLAIN_NAME_DEFAULTS)."""
        defaults = PLAIN_NAME_DEFAULTS.get(self.bits, {})
        skip = ("bits", "key_axis") if self.axis_settled else ("bits",)
        return join_spec(f"int{self.bits}", changed_fields(self, skip=skip, defaults=defaults))

    def for_policy(self, evicts: bool) -> IntNCodec:
        """Settle `key_axis`: per-channel key groups cannot lose single tokens, so eviction needs per-token keys."""
        if self.key_axis is None:
            settled = replace(self, key_axis="token" if evicts else "channel")
            for bound in ("inv_freq", "settled_rotation", "model_key_scales"):  # replace() resets init=False fields
                object.__setattr__(settled, bound, getattr(self, bound))
            object.__setattr__(settled, "axis_settled", True)
            return settled
        if self.key_axis == "channel" and evicts:
            raise ValueError(
                "key_axis='channel' groups keys across tokens and cannot be combined with an evicting policy; "
                "use key_axis='token' (or leave key_axis unset)"
            )
        return self

    def for_layer(self, layer_idx: int) -> IntNCodec:
        wide = layer_idx in self.widened
        if self.rotate == "none" and not wide and self.model_key_scales is None:
            return self
        layered = copy.copy(self)
        object.__setattr__(layered, "layer", layer_idx)
        if self.model_key_scales is not None:
            scales = self.model_key_scales.tensor
            if layer_idx >= scales.shape[0]:
                raise ValueError(f"the key scales hold {scales.shape[0]} layers, not layer {layer_idx}")
            object.__setattr__(layered, "layer_key_scale", KeyScales(scales[layer_idx]))
        if wide:
            object.__setattr__(layered, "bits", self.wide_bits)
            object.__setattr__(layered, "wide_layers", "")
        return layered

    def _rotates(self, kind: Kind) -> bool:
        rotate = self.settled_rotation or ("hadamard" if self.rotate == "auto" else self.rotate)
        return rotate == "hadamard" or (rotate == "per_token" and not self._per_channel(kind))

    def _seed(self, kind: Kind) -> int:
        return 2 * self.layer + (kind == "value")

    def _per_channel(self, kind: Kind) -> bool:
        return kind == "key" and self.key_axis == "channel"

    def _key_scale(self, kind: Kind, states: torch.Tensor) -> torch.Tensor | None:
        """[H_kv, 1, D] float32 scale of keys grouped per token in this layer, or None where keys are not scaled."""
        if kind != "key" or self.layer_key_scale is None or self._per_channel(kind):
            return None
        scale = self.layer_key_scale.on(states.device)
        if scale.shape[0] != states.shape[1] or scale.shape[1] != states.shape[-1]:
            raise ValueError(f"the key scales hold {scale.shape[0]} KV heads x {scale.shape[1]} channels, the keys "
                             f"have {states.shape[1]} x {states.shape[-1]}")
        return scale[:, None, :]

    def token_block(self, kind: Kind) -> int:
        return self.group(kind) if self._per_channel(kind) else 1

    def group(self, kind: Kind) -> int:
        """The values sharing one scale and zero point for `kind`: `value_group_size` for values, `key_group_size`
        for per-channel keys, where given; `group_size` otherwise (keys grouped per token always)."""
        own = self.value_group_size if kind == "value" else self.key_group_size if self._per_channel(kind) else None
        return self.group_size if own is None else own

    @property
    def channel_step(self) -> int:
        """What a stored width must be a multiple of: the groups that run along the channels, which a lowrank
        stack's ranks are whole steps of: the values', and `group_size` where keys are grouped per token. An
        unsettled axis (None) counts as per channel, what a policy without eviction settles it to; an evicting
        policy settles it per token later, and `check_head_dim` then refuses a group that does not divide a rank."""
        step = self.group("value")
        return math.lcm(step, self.group_size) if self.key_axis == "token" else step

    def check_head_dim(self, head_dim: int) -> None:
        unit = values_per_unit(self.bits)
        if head_dim % unit:
            raise ValueError(
                f"head_dim {head_dim} cannot be packed at {self.bits} bits: it must be a multiple of {unit}"
            )
        # Values are always grouped along head_dim (keys too, unless key_axis="channel"), so the group must divide it.
        for kind in ("value", "key"):
            if kind == "key" and self.key_axis == "channel":
                continue
            if head_dim % self.group(kind):
                name = "group_size" if kind == "key" or self.value_group_size is None else "value_group_size"
                raise ValueError(f"{name} must divide head_dim ({head_dim}), got {self.group(kind)}")

    def _gaussian(self, kind: Kind) -> bool:
        return self.codebook == "gaussian" and not self._per_channel(kind)

    def _quantize(self, grouped: torch.Tensor, kind: Kind, reduce_dim: int):
        quantize = _quantize_gaussian if self._gaussian(kind) else _quantize
        return quantize(grouped, self.bits, reduce_dim)

    def _levels(self, codes: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Codes -> multiples of the scale: the codes themselves on the uniform grid, Lloyd-Max levels otherwise."""
        if self._gaussian(kind):
            return levels_tensor(self.bits, codes.device)[codes.long()]
        return codes.float()

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        b, h, t, d = states.shape
        if self.pre_rope and self._per_channel(kind):
            if t % self.group(kind):
                raise ValueError(f"per-channel key groups need a multiple of {self.group(kind)} tokens, got {t}")
            states = self._group_rope(states, -1)
        scale = self._key_scale(kind, states)
        if scale is not None:
            states = states.float() / scale
        if self._rotates(kind):
            states = rotate_rows(states, self._seed(kind))
        if self._per_channel(kind):
            g = self.group(kind)
            if t % g:
                raise ValueError(f"per-channel key groups need a multiple of {g} tokens, got {t}")
            grouped = states.reshape(b, h, t // g, g, d)
            codes, scale, zero = self._quantize(grouped, kind, reduce_dim=3)
            return {
                "codes": pack(codes.reshape(b, h, t, d), self.bits),
                "scale": scale.reshape(b, h, t // g, d),
                "zero": zero.reshape(b, h, t // g, d),
            }
        grouped = states.reshape(b, h, t, d // self.group(kind), self.group(kind))
        codes, scale, zero = self._quantize(grouped, kind, reduce_dim=4)
        return {"codes": pack(codes.reshape(b, h, t, d), self.bits), "scale": scale[..., 0], "zero": zero[..., 0]}

    @property
    def attends_encoded(self) -> bool:  # type: ignore[override]
        """Always: pre_rope turns each per-channel key by its offset in its group, and `key_logits` meets it
        with one query per offset (plane_attention.channel_group_logits_by_offset)."""
        return True

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return self.from_basis(self.decode_in_basis(encoded, kind, torch.float32), kind).to(dtype)

    def to_basis(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        scale = self._key_scale(kind, x)
        x = x if scale is None else x.float() / scale
        return rotate_rows(x, self._seed(kind)) if self._rotates(kind) else x

    def key_query(self, query: torch.Tensor) -> torch.Tensor:
        """The storage basis divides each key channel by its scale, so the query takes the scale: (q s) . (k / s)."""
        scale = self._key_scale("key", query)
        query = query if scale is None else query.float() * scale
        return rotate_rows(query, self._seed("key")) if self._rotates("key") else query

    def from_basis(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        out = rotate_rows(x, self._seed(kind), inverse=True) if self._rotates(kind) else x
        scale = self._key_scale(kind, out)
        if scale is not None:
            out = out.float() * scale
        if self.pre_rope and self._per_channel(kind):
            out = self._group_rope(out, 1)
        return out

    def decode_in_basis(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(encoded["codes"], self.bits)
        b, h, t, d = codes.shape
        scale, zero = encoded["scale"].float(), encoded["zero"].float()
        if self._per_channel(kind):
            g = self.group(kind)
            levels = self._levels(codes, kind).reshape(b, h, t // g, g, d)
            out = levels * scale[:, :, :, None, :] + zero[:, :, :, None, :]
        else:
            levels = self._levels(codes, kind).reshape(b, h, t, d // self.group(kind), self.group(kind))
            out = levels * scale[..., None] + zero[..., None]
        return out.reshape(b, h, t, d).to(dtype)

    def _folded_levels(self, kind: Kind) -> tuple[float, float, float] | None:
        """How attention reads the codes without decoding them (codecs/plane_attention.py), or None where it
        cannot: 3 bits (codes straddle bytes), groups that split a byte, Gaussian levels beyond 2 bits."""
        if self.bits not in plane_attention.FOLDABLE_BITS or self.group(kind) % values_per_unit(self.bits):
            return None
        return plane_attention.affine_levels(lloyd_max_levels(self.bits) if self._gaussian(kind) else None)

    def key_logits(self, encoded: Encoded, query: torch.Tensor) -> torch.Tensor:
        levels = self._folded_levels("key")
        turned = self.pre_rope and self._per_channel("key")
        if levels is None and turned:  # 3 bits: decode the block (whole key groups) and meet the plain query
            plain = rotate_rows(query, self._seed("key"), inverse=True) if self._rotates("key") else query.float()
            return torch.matmul(plain, self.decode(encoded, "key", torch.float32).transpose(-1, -2))
        if levels is None:
            return super().key_logits(encoded, query)
        parts = encoded["codes"], encoded["scale"], encoded["zero"], query.float()
        if turned:
            parts = parts[:3] + (self.offset_queries(query.float()),)
            return plane_attention.channel_group_logits_by_offset(*parts, self.bits, self.group("key"))
        if self._per_channel("key"):
            return plane_attention.channel_group_logits(*parts, self.bits, self.group("key"))
        return plane_attention.token_group_logits(*parts, self.bits, self.group("key"), levels)

    def offset_queries(self, query: torch.Tensor) -> torch.Tensor:
        """pre_rope: the storage-basis query [B, H, n, D] as each offset o of a key group must meet it, turned
        back by o positions (q . R_o k = R_-o q . k): [B, H, n, group_size, D]."""
        if not (self.pre_rope and self._per_channel("key")):
            return super().offset_queries(query)
        plain = rotate_rows(query, self._seed("key"), inverse=True) if self._rotates("key") else query
        return self._turned_offsets(plain)

    def kernel_queries(self, query: torch.Tensor) -> torch.Tensor:
        # Per-channel keys take no key scale, so `key_query` would rotate the query into the storage basis and
        # `offset_queries` straight back (two products per layer and decode step): turn the model's query itself.
        if not (self.pre_rope and self._per_channel("key")):
            return super().kernel_queries(query)
        return self._turned_offsets(query)

    def kernel_rotations(
        self, key_dim: int, value_dim: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # The key query is the rotation alone where keys take no scale, after pre_rope's turns where the offsets are
        # turned by the model's RoPE (`kernel_turns`); values come back by the rotation alone (the key scale and
        # pre_rope are the keys').
        plain_keys = self.layer_key_scale is None or self._per_channel("key")
        turns_known = not (self.pre_rope and self._per_channel("key")) or bool(self.inv_freq)
        key = None
        if self._rotates("key") and plain_keys and turns_known:
            key = rotation_matrix(key_dim, self._seed("key"), device)
        value = rotation_matrix(value_dim, self._seed("value"), device) if self._rotates("value") else None
        return key, value

    def kernel_turns(self, device: torch.device) -> torch.Tensor | None:
        if not (self.pre_rope and self._per_channel("key") and self.inv_freq):
            return None
        return _offset_turn_table(self.inv_freq, self.group("key"), device)

    def _turned_offsets(self, plain: torch.Tensor) -> torch.Tensor:
        """`offset_queries` of the query [B, H, n, D] in the model's basis: [B, H, n, group_size, D]."""
        b, h, n, d = plain.shape
        g = self.group("key")
        if self.inv_freq:  # _group_rope(copies, -1) with its table cached and the half-swap once per row, not per copy
            cos, sin = _offset_turns(self.inv_freq, g, -1, plain.device)
            turned = turn(plain.float()[:, :, :, None, :], cos, sin)  # [B, H, n, g, D]: the table broadcasts over g
            turned = turned.reshape(b, h, n * g, d)  # row n*g + o: offset o
        else:  # no RoPE frequencies: _group_rope says what is missing, or leaves the copies as they are
            turned = self._group_rope(plain[:, :, :, None, :].expand(b, h, n, g, d).reshape(b, h, n * g, d), -1)
        if self._rotates("key"):  # to_basis, for many rows at once
            turned = rotate_batch_rows(turned, self._seed("key"))
        return turned.reshape(b, h, n, g, d)

    def kernel_layout(self, kind: Kind) -> KernelLayout | None:
        levels = self._folded_levels(kind)  # the kernel reads what the planes read, from its bytes
        if levels is None:
            return None
        return KernelLayout(self.bits, levels, offset_queries=self.pre_rope and self._per_channel(kind))

    def plain_codes(self, kind: Kind, width: int, tokens: int, device: torch.device) -> AffineCodes | None:
        # `decode` is codes * scale + zero, then the inverse rotation where this kind rotates, for 4-bit codes on
        # the uniform grid. Not so (None): other widths, Lloyd-Max levels, pre_rope's turns and key scales, which
        # `from_basis` applies after the rotation; and a rotated store of at most MATRIX_TOKENS tokens, which
        # `rotate_rows` turns back by a matrix product (other roundings than the transform the kernel runs).
        if self.bits != 4 or self._gaussian(kind) or (self.pre_rope and self._per_channel(kind)) \
                or (kind == "key" and self.layer_key_scale is not None and not self._per_channel(kind)) \
                or (self._rotates(kind) and tokens <= MATRIX_TOKENS):
            return None
        signs = random_signs(width, self._seed(kind), device) if self._rotates(kind) else None
        return AffineCodes(self.group(kind), self._per_channel(kind), signs)

    def mix_values(self, encoded: Encoded, probs: torch.Tensor) -> torch.Tensor:
        levels = self._folded_levels("value")
        if levels is None:
            return super().mix_values(encoded, probs)
        parts = encoded["codes"], encoded["scale"], encoded["zero"], probs.float()
        return plane_attention.token_group_mix(*parts, self.bits, self.group("value"), levels)

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        # packed codes + bf16 scale and zero per group of the kind: (bits + 32 / group) / 8 bytes per value.
        return head_dim * self.bits / 8 + head_dim * 4 / self.group(kind)
