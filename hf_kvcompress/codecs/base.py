"""A codec decides how each kept token's key and value are stored; a policy decides which tokens are kept."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..ops.cpu_decode import AffineCodes, KernelLayout
from ..spec_text import changed_fields, join_spec

Kind = Literal["key", "value"]
# An encoded block: named tensors whose axis 2 runs over tokens (or over groups of `token_block` tokens).
Encoded = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Codec(ABC):
    """Stores [B, H_kv, T, D] key or value states in fewer bytes.

    `residual_length` recent tokens stay at full precision before they are encoded (KIVI's residual). A codec
    whose `token_block(kind)` is 1 encodes each token on its own, so an eviction policy can drop single tokens from
    the encoded store without decoding and re-encoding anything.
    """

    name: ClassVar[str] = ""  # the registry's name for the codec (`fp8`), the head of its spec string
    residual_length: ClassVar[int] = 0
    sink_tokens: ClassVar[int] = 0  # first real tokens of each row the layer keeps at full precision
    lossless: ClassVar[bool] = False
    heads_per_store: ClassVar[int] = 1  # KV heads sharing one stored head (shared_heads); eviction agrees per group
    # Attention may read the store a block of tokens at a time through `key_logits` and `mix_values`
    # (caches/store_attention.py)
    attends_encoded: ClassVar[bool] = False
    # Tokens are encoded as they arrive, before attention reads them, so every query reads every token as stored
    # (its own step's included, as serving engines' fp8 caches do). Without a residual this makes a step's output
    # independent of how tokens are grouped into steps: one at a time, prompt chunks, or speculative decoding's
    # multi-token verification steps answer alike. Otherwise a step's own tokens are read at full precision.
    encodes_on_arrival: ClassVar[bool] = False
    # Keys are encoded and decoded with their positions: `encode(states, "key", positions=...)` and
    # `decode(encoded, "key", dtype, positions=...)`, positions [B, H_kv, T] the position each key was rotated to
    # (lowrank's joint bases project keys with RoPE undone). The layer then tracks each slot's position.
    needs_positions: ClassVar[bool] = False
    # A decode step may read the layer (store, exact sinks, tail) in one call of the codec's own kernel
    # (`attend_layer`; lowrank's on CPU).
    layer_kernel: ClassVar[bool] = False

    @property
    def exact_sinks(self) -> int:
        """The first real tokens of each row the layer keeps exact beside the store (caches/codec_sinks.py): the
        codec's `sink_tokens`; a stack of codecs (`lowrank+int4`) keeps the most any of them asks for."""
        return self.sink_tokens

    @property
    def exact_residual(self) -> int:
        """The newest tokens the layer keeps at full precision before encoding them (caches/storage.py): the codec's
        `residual_length`; a stack of codecs (`lowrank:residual_length=64+int4`) keeps the most any of them asks
        for."""
        return self.residual_length

    @property
    def whole_residual(self) -> int:
        """Of the `exact_residual` newest tokens, how many the layer holds as the model's whole states; the older
        ones are held by `residual_codec` (caches/storage.py). Every one, unless the codec is a stack."""
        return self.exact_residual

    @property
    def residual_codec(self) -> Codec | None:
        """How the layer holds its exact residual's tokens beyond `whole_residual`, at full precision before they are
        encoded (`encode_residual`), or None: every one whole. A stack (`lowrank+int4`) holds them as its reduction
        alone stores them: the storage's residual holds the reduced states (lowrank's latents), not whole vectors."""
        return None

    def encode_residual(self, held: Encoded, kind: Kind, dtype: torch.dtype) -> Encoded:
        """Tokens `residual_codec` holds (`held`, of a model running in `dtype`) as this codec encodes them."""
        raise NotImplementedError(f"{type(self).__name__} holds no residual in another codec (residual_codec)")

    def token_block(self, kind: Kind) -> int:
        """How many tokens are encoded together along the token axis."""
        return 1

    @abstractmethod
    def encode(self, states: torch.Tensor, kind: Kind) -> Encoded: ...

    @abstractmethod
    def decode(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def bytes_per_token(self, head_dim: int, kind: Kind, dtype: torch.dtype) -> float:
        """Bytes one encoded token takes per KV head, scales included: the promise `measured_kv_bytes` checks."""

    def for_layer(self, layer_idx: int) -> Codec:
        """The codec as it runs in decoder layer `layer_idx`; codecs with per-layer state override this."""
        return self

    def for_device(self, device: torch.device) -> Codec:
        """The codec as it stores states on `device` (bound by the layer at its first step or load, before anything
        is encoded or counted); a codec whose stored form depends on the device (lowrank's `compute="auto"`)
        settles it here."""
        return self

    def as_stored(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> Encoded:
        """A loaded encoding (`TokenStore.from_state`) in the form this codec stores `kind` in for a model running
        in `dtype` on its device (`for_device`): as it is, unless that form depends on the device."""
        return encoded

    def decode_in_basis(self, encoded: Encoded, kind: Kind, dtype: torch.dtype) -> torch.Tensor:
        """Decode into the basis the states are stored in (`to_basis` of the states): attention can rotate one
        query and one output instead of every stored token (q . k = to_basis(q) . to_basis(k) for a rotation)."""
        return self.decode(encoded, kind, dtype)

    def key_logits(self, encoded: Encoded, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, n, D] (in the storage basis) . the encoded keys -> [B, H, n, T]. Codecs override this to
        read their codes without decoding the block (caches/store_attention.py); this is the reference."""
        return torch.matmul(query, self.decode_in_basis(encoded, "key", torch.float32).transpose(-1, -2))

    def mix_values(self, encoded: Encoded, probs: torch.Tensor) -> torch.Tensor:
        """probs [B, H, n, T] times the encoded values -> [B, H, n, Dv] in the storage basis (see `key_logits`)."""
        return torch.matmul(probs, self.decode_in_basis(encoded, "value", torch.float32))

    def attend_layer(self, keys: Encoded | None, values: Encoded | None, query: torch.Tensor, bias: torch.Tensor | None,
                     sink_slots: torch.Tensor | None, sink_keys: torch.Tensor | None, sink_values: torch.Tensor | None,
                     tail_keys: torch.Tensor, tail_values: torch.Tensor,
                     positions: torch.Tensor | None = None, held_keys: Encoded | None = None,
                     held_values: Encoded | None = None) -> torch.Tensor | None:
        """A layer's attention in one call of the codec's own kernel, or None (the default: attention reads the store
        a block at a time through `key_logits` and `mix_values`, and the sinks and the tail as segments of the same
        softmax, caches/store_attention.py). query [B, H, n, D] (scaled, the model's basis, which `key_query` keeps);
        keys / values the whole encoded store (None: nothing encoded yet) and `held_keys` / `held_values` the slots
        after it that `residual_codec` holds (a stack's reduced residual; None: none), T slots together; bias
        [B or 1, H or 1, q, T + Tt] float32 added to the logits (row m of n reads row m % q; a sink reads its slot's
        column, the tail columns T on), or None; the exact sinks sink_keys / sink_values [B, H, S, D] at slots
        sink_slots [B, H, S] (a slot outside [0, T): none, or one still in the tail), or None; the full-precision
        tail [B, H, Tt, D]; positions [B, H, T] for a codec that `needs_positions`. Returns [B, H, n, Dv] float32,
        normalised."""
        return None

    def kernel_layout(self, kind: Kind) -> KernelLayout | None:
        """How a decode-attention kernel reads this kind's encoding (ops/cpu_decode.py), or None: then attention
        reads it through `key_logits` and `mix_values`."""
        return None

    def plain_codes(self, kind: Kind, width: int, tokens: int, device: torch.device) -> AffineCodes | None:
        """How a kernel turns this kind's encoding of `tokens` `width`-wide states back into what `decode` gives,
        reading its codes where they lie (`ops.cpu_decode.AffineCodes`: 4-bit codes, a scale and zero point per
        group, maybe a Hadamard rotation), or None where `decode` does more than that (the caller then decodes)."""
        return None

    def offset_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, n, D] (storage basis) -> [B, H, n, O, D]: the query each token offset within a key group
        meets (O = 1 unless `kernel_layout("key").offset_queries`)."""
        return query[:, :, :, None]

    def kernel_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, n, D] (the model's basis) -> [B, H, n, O, D]: what a decode kernel meets the stored keys
        with, `offset_queries(key_query(query))`; a codec may get there in fewer steps."""
        return self.offset_queries(self.key_query(query))

    def kernel_rotations(
        self, key_dim: int, value_dim: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Orthogonal float32 matrices (R_k [D, D], R_v [Dv, Dv]) on `device` that a decode kernel applies itself:
        `kernel_queries(q)` is (q @ R_k)[:, :, :, None], or with `kernel_turns` each offset's turned query times R_k,
        and `from_basis(x, "value")` is x @ R_v.T, up to rounding. None where the codec does not get there by that
        product (the caller then calls those methods)."""
        return None, None

    def kernel_turns(self, device: torch.device) -> torch.Tensor | None:
        """[2, O, R] float32 (cos, sin: `rerotate.rope_table` of each offset o < O of a key group), where
        `kernel_queries(q)` turns q by each offset (`rerotate.turn`) before `kernel_rotations`' R_k; None: one query
        per token."""
        return None

    def to_basis(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        """x [..., D] in the storage basis of `kind` (the identity unless the codec rotates)."""
        return x

    def from_basis(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Inverse of `to_basis`."""
        return x

    def key_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H_kv, n, D] -> the query that meets the keys in their storage basis: q . k =
        key_query(q) . decode_in_basis(k). `to_basis(q, "key")` for a rotation; a codec that also scales key
        channels (int4's key_scale) multiplies the query by the scale where it divides the keys."""
        return self.to_basis(query, "key")

    def for_reduced_states(self) -> Codec:
        """The codec as the storage of a reducing codec (`shared_heads+int4`), whose states are not the model's own
        head vectors: a codec that reads per-model statistics of those vectors drops or refuses them."""
        return self

    def check_head_dim(self, head_dim: int) -> None:  # noqa: B027  (a hook: by default every head_dim fits)
        """Raise ValueError if this codec cannot store vectors of `head_dim` values."""

    def spec(self) -> str:
        """The spec string that rebuilds this codec (its name and the fields that differ from the defaults)."""
        return join_spec(self.name, changed_fields(self))


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def index_op(tensor: torch.Tensor, op) -> torch.Tensor:
    """Apply an indexing op; float8 tensors go through a uint8 view, since CPU kernels lack float8 gathers."""
    if tensor.dtype in _FLOAT8:
        return op(tensor.view(torch.uint8)).view(tensor.dtype)
    return op(tensor)


def cat_encoded(first: Encoded | None, second: Encoded) -> Encoded:
    """Append `second` after `first` along the token axis."""
    if first is None:
        return second
    return {
        name: index_op(first[name], lambda t, name=name: torch.cat([t, second[name].view(t.dtype)], dim=2))
        for name in first
    }


def slice_encoded(encoded: Encoded, start: int, end: int, tokens: int) -> Encoded:
    """Tokens [start, end) of an encoding of `tokens` tokens, as views; tensors stored per group of g tokens are
    cut at start // g and end // g (the caller keeps both on group boundaries)."""
    out = {}
    for name, tensor in encoded.items():
        per_entry = tokens // tensor.shape[2]
        out[name] = tensor[:, :, start // per_entry : end // per_entry]
    return out


def gather_encoded(encoded: Encoded, index: torch.Tensor) -> Encoded:
    """Keep the tokens `index` [B, H, K] of a token-wise (`token_block` 1) encoding, per batch row and head."""
    out = {}
    for name, tensor in encoded.items():
        heads = index
        if tensor.shape[1] != index.shape[1]:
            # Stored per group of heads (shared_heads): the layer makes each group agree on one selection.
            heads = index[:, :: index.shape[1] // tensor.shape[1]]
        shape = list(heads.shape) + list(tensor.shape[3:])
        idx = heads.view(*heads.shape, *([1] * (tensor.dim() - 3))).expand(shape)
        out[name] = index_op(tensor, lambda t, idx=idx: torch.gather(t, 2, idx).contiguous())
    return out


def select_batch(encoded: Encoded | None, index: torch.Tensor) -> Encoded | None:
    """Rows `index` of the batch (beam search, batch selection)."""
    if encoded is None:
        return None
    return {
        name: index_op(tensor, lambda t: t.index_select(0, index.to(t.device))) for name, tensor in encoded.items()
    }


def resolve_for_policy(codec: Codec, evicts: bool) -> Codec:
    """The codec as it will run beside a policy that does (or does not) evict tokens."""
    resolve = getattr(codec, "for_policy", None)
    return resolve(evicts) if resolve is not None else codec


def resolve_for_model(codec: Codec, config) -> Codec:
    """The codec bound to the model it serves: codecs that read the model's shape or calibration define
    `for_model(config)`, and they need the config (transformers builds layers without one lazily). Given a config,
    every such codec is bound, also those that only use it when it is there (int4's `rotate=auto`)."""
    resolve = getattr(codec, "for_model", None)
    if resolve is None:
        return codec
    if config is None:
        if not getattr(codec, "needs_model", True):  # a codec may need the model for some options only
            return codec
        raise ValueError(
            f"codec {type(codec).__name__} needs the model's config: pass config=model.config to CompressedCache, "
            "or build the cache with make_cache(spec, model.config)"
        )
    return resolve(config)


def agree_within_groups(scores: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """Average per-head eviction scores [B, H_kv, T] over groups of `group` heads that share one store, so every
    head of a group keeps the same tokens."""
    if scores is None or group == 1 or scores.shape[1] == 1:
        return scores
    b, h, t = scores.shape
    mean = scores.reshape(b, h // group, group, t).mean(2, keepdim=True)
    return mean.expand(b, h // group, group, t).reshape(b, h, t)
