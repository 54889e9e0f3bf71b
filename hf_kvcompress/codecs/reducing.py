"""Codecs that first shrink the states (fewer heads, fewer dimensions), then hand them to a storage codec."""

from __future__ import annotations

import copy
from abc import abstractmethod
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from ..spec_text import changed_fields, join_spec, pin_fields
from .base import Codec, Encoded, Kind, resolve_for_model, resolve_for_policy
from .identity import IdentityCodec


@dataclass(frozen=True)
class ReducingCodec(Codec):
    """`reduce` maps [B, H_kv, T, D] to a smaller tensor, `storage` stores it, `expand` maps it back.

    Stacking is how the lesson's combinations are built: `shared_heads+int8` shares heads, then quantizes the
    shared heads. The storage codec's residual and token blocks apply unchanged to the reduced states. The storage
    codec is bound to the model as it would be alone (`for_model`: `int4` rotates as plain `int4` does on that model)
    and to each decoder layer (`for_layer`: its rotation signs, `wide_layers`).
    """

    # Whether the reduced states are still the model's head vectors, turned by RoPE as the model turns them (the
    # mean of heads at one position is; coordinates on a basis are not): only then may the storage read the model's
    # RoPE frequencies (pre_rope).
    keeps_rope: ClassVar[bool] = True
    # Whether the storage's residual holds the reduced states (`residual_codec`) rather than whole vectors. lowrank's
    # does; shared_heads' does not: holding its 128 newest tokens as stored heads lost an answer that whole vectors
    # keep (`shared_heads:ratio=0.67+int4`, SmolLM2's development half, 9 / 10 against 10 / 10; docs/results.md,
    # "Low rank at 2x + int4: the residual as latents").
    holds_reduced_residual: ClassVar[bool] = False

    storage: Codec = field(default_factory=IdentityCodec)

    @abstractmethod
    def reduce(self, states: torch.Tensor, kind: Kind) -> torch.Tensor: ...

    @abstractmethod
    def expand(self, reduced: torch.Tensor, kind: Kind, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def stored_fraction(self, head_dim: int) -> tuple[int, float]:
        """(dims stored per stored head, KV heads per stored head)."""

    @property
    def residual_length(self) -> int:  # type: ignore[override]
        return getattr(self.storage, "residual_length", 0)

    @property
    def sink_tokens(self) -> int:  # type: ignore[override]
        """The storage's full-precision sinks (`shared_heads+int4` keeps int4's 4, as plain `int4` does; `lowrank`
        has its own, `LowRankCodec.sink_tokens`).

        A sink bypasses the whole codec, reduction included: the cache copies the model's own states before
        anything is encoded and puts them back over their decoded slots (caches/codec_sinks.py), so a sink reads
        exactly as under the plain storage codec. Bypassing the quantization only would keep a group's mean
        (shared_heads) or a projection on a basis fitted to typical tokens (lowrank) for the very tokens that draw
        the most attention; the exact copy costs sink_tokens x KV heads x (key + value dims) per row and layer,
        stored and counted as such (`promised_bytes`, `measured_kv_bytes`)."""
        return getattr(self.storage, "sink_tokens", 0)

    @property
    def exact_sinks(self) -> int:
        """Each codec of the stack asks for its first tokens to bypass the whole stack, so the stack keeps the most
        any asks for: `lowrank+int4:sink_tokens=8` keeps 8, `lowrank:sink_tokens=0+int4:sink_tokens=0` none."""
        return max(self.sink_tokens, self.storage.exact_sinks)

    @property
    def exact_residual(self) -> int:
        """As `exact_sinks`, the most any codec of the stack asks for: the newest tokens held at full precision before
        they are encoded. The reduction's own window (`lowrank:residual_length=128`) bypasses the whole stack (whole
        vectors, `whole_residual`); the rest of the storage's residual holds the reduced states (`residual_codec`)."""
        return max(self.residual_length, self.storage.exact_residual)

    @property
    def own_residual(self) -> int:
        """The newest tokens the reduction itself keeps whole (lowrank's `residual_length`); 0 here: the base's
        `residual_length` is the storage's."""
        return 0

    @property
    def whole_residual(self) -> int:
        """Where the stack `holds_reduced_residual`, only the reduction's own window bypasses the whole stack; the
        rest of the storage's residual holds the reduced states (`residual_codec`): `lowrank:ratio=0.5+int4` holds
        int4's newest tokens as latents beyond lowrank's 32 whole ones. Otherwise every one is whole."""
        if not self.holds_reduced_residual:
            return self.exact_residual
        return min(self.own_residual, self.exact_residual)

    @property
    def residual_codec(self) -> ReducingCodec | None:
        """The reduction alone (its reduced states at full precision), as the storage's residual holds them: "The
        storage codec's residual and token blocks apply unchanged to the reduced states". None when the storage
        keeps them as they are (`lowrank` alone: nothing is encoded after the reduction)."""
        if self.storage.lossless or not self.holds_reduced_residual:
            return None
        return self.with_storage(IdentityCodec())

    def encode_residual(self, held: Encoded, kind: Kind, dtype: torch.dtype) -> Encoded:
        """Reduced states held by `residual_codec` as the storage encodes them, in the model's `dtype` as `encode`
        hands them over (an identity encoding: the states themselves)."""
        return self.storage.encode(IdentityCodec().decode(held, kind, dtype).to(dtype), kind)

    def token_block(self, kind: Kind) -> int:
        return self.storage.token_block(kind)

    def with_storage(self, storage: Codec) -> ReducingCodec:
        """A copy storing with `storage`; unlike `replace`, it keeps what binding set (init=False fields)."""
        if storage is self.storage:
            return self
        copied = copy.copy(self)
        object.__setattr__(copied, "storage", storage)
        return copied

    def reduction_for_model(self, config) -> ReducingCodec:
        """The reduction bound to the model (its shape, its calibration); the storage is bound by `for_model`."""
        return self

    def for_model(self, config) -> ReducingCodec:
        """Bind the reduction, then the storage codec, to the model. The storage sees the model's own config: what
        it reads there (the family for `rotate=auto`, the layer count for `wide_layers`, the RoPE frequencies for
        `pre_rope`) holds for the reduced states too, except the RoPE frequencies when the reduction does not keep
        the head vectors (`keeps_rope`), where pre_rope is refused."""
        self._check_pre_rope()
        bound = self.reduction_for_model(config)
        return bound.with_storage(resolve_for_model(bound.storage, config).for_reduced_states())

    def _check_pre_rope(self) -> None:
        innermost = self.storage
        while isinstance(innermost, ReducingCodec):
            innermost = innermost.storage
        if not self.keeps_rope and getattr(innermost, "pre_rope", False):
            raise ValueError(
                f"pre_rope must be false for a codec stored after {self.name}: its reduced states are not the "
                f"model's RoPE-turned head vectors; write {self.name}+{replace(innermost, pre_rope=False).spec()}"  # type: ignore[call-arg]  # a codec with pre_rope: checked
            )

    def for_policy(self, evicts: bool) -> ReducingCodec:
        return self.with_storage(resolve_for_policy(self.storage, evicts))

    def for_layer(self, layer_idx: int) -> ReducingCodec:
        return self.with_storage(self.storage.for_layer(layer_idx))

    def for_device(self, device: torch.device) -> ReducingCodec:
        return self.with_storage(self.storage.for_device(device))

    def check_head_dim(self, head_dim: int) -> None:
        self.storage.check_head_dim(self.stored_fraction(head_dim)[0])

    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded:
        return self.storage.encode(self.reduce(states, kind), kind)

    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        return self.expand(self.storage.decode(encoded, kind, dtype), kind, dtype)

    @classmethod
    def storage_defaults(cls, arguments: dict, storage: str) -> dict:
        """Defaults this reduction gives the fields of a storage codec named `storage` (a spec's name, `int4`) when
        the spec does not give them, for a reduction spec'd with `arguments` (its own fields as the spec gives them):
        where the stored states are not the model's head vectors, the storage's best settings may differ from its
        plain name's. The registry fills them in (`parse_spec`); `spec` names them whatever their values. None
        here."""
        return {}

    def spec(self) -> str:
        """`name[:args]`, then `+storage` when the reduced states are stored by another codec (`shared_heads+int8`);
        the storage fields this reduction gives defaults of its own (`storage_defaults`) are always named, so that
        the spec rebuilds the same storage with or without those defaults (a file saved before them reads so)."""
        head = join_spec(self.name, changed_fields(self, skip=("storage",)))
        if isinstance(self.storage, IdentityCodec):
            return head
        storage = self.storage.spec()
        arguments = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "storage"}
        pinned = type(self).storage_defaults(arguments, storage.partition(":")[0])
        return f"{head}+{pin_fields(storage, {key: getattr(self.storage, key) for key in pinned})}"

    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        dims, heads_per_stored = self.stored_fraction(head_dim)
        return self.storage.bytes_per_token(dims, kind, dtype) / heads_per_stored
