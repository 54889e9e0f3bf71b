"""Each decoder layer's plan: the policy, codec, window and RoPE frequencies a (policy, codec, model config) gives it.

One pure function, `plan_layers`, decides them; `CompressedCache` builds its layers from the plans, and
`study.promised_bytes` counts bytes from the same plans, so an estimate cannot follow other rules than the cache.
Sliding-window layers keep transformers' window with the codec's own key grouping, or under a budget or ratio their
newest tokens; the policy applies to the full-attention layers. A plain KVzip ratio below a half, alone or (without
sliding-window layers) with the plain `int4`, is planned as KVzip's byte target (`ratio_as_bytes`, below). Other plain
ratios of a policy that ranks every layer's pairs at once (KVzip's from a half up, KVzap's) plan how the hybrid model's
pairs are shared (`SlidingShare`): the sliding layers keep fewer than the ratio's share of their window and the full-
attention layers, where long-range retrieval happens, keep what they give up, so the whole cache still holds the ratio
of its uncompressed pairs. KVzip's `bytes=B` (`ByteTarget`) gives a hybrid model's sliding layers a wide window of their
newest tokens in a cheap codec (`byte_sliding_tokens`, `BYTES_SLIDING_CODEC`) and the full-attention layers the pairs
whose bytes fit in what is left of B of the uncompressed cache's bytes. KVzap's `budget=N` with head budgets
(`plans_budget_share`) keeps a half's planned share in the sliding layers and gives the full-attention layers the rest
of the pairs N tokens in every layer would hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..budget import served_dtype
from ..calibration import floors_file, load_floors
from ..codecs.base import Codec, resolve_for_model, resolve_for_policy
from ..codecs.identity import IdentityCodec
from ..codecs.intn import PLAIN_NAME_DEFAULTS, IntNCodec
from ..codecs.reducing import ReducingCodec
from ..hf.compat import text_config
from ..hf.rope import rope_inv_freq
from ..policies.base import Policy, check_count
from ..policies.block_window import BlockWindowPolicy
from ..policies.sink_window import SinkWindowPolicy
from ..probes import load_probes

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
# The least share of its window a planned sliding layer keeps (`sliding_kept`): on Gemma-3-270M's development half
# at an eighth 16 of its 511 tokens kept more answers than 31 (the full-attention layers get what they free), and 8
# answered nothing (docs/results.md).
SLIDING_FLOOR = 1 / 32
# The share of its window a sliding layer keeps under KVzap's `budget=` on a hybrid model (`budget_sliding_tokens`),
# planned as a half is (`planned_sliding_tokens`: 128 of Gemma-3-270M's 511, as `kvzip:ratio=0.5`'s sliding layers).
# On Gemma-3-270M's development half after 512 decoded tokens 128 and 16 kept the same 5 of 5 answers (docs/results.md,
# "KVzap's budget on Gemma-3: the sliding layers' allowance"); `sliding=16` is the recipe for fewer bytes.
BUDGET_SLIDING_SHARE = 0.5
# KVzip's `bytes=B` on a hybrid model (`byte_sliding_tokens`, `byte_codecs`): each sliding layer keeps
# BYTES_SLIDING_SCALE x B x B of its window in int4, and a plain `bytes=B` stores the full-attention layers in int4
# too, on every model (`byte_plan_codec`: the codec by layout). Why a wide window in int4: at a quarter the answers
# were lost to the sliding layers' cut, not to the ranking, and a wide window in few bytes kept them; below a quarter
# the full-attention layers need what is left more (chosen on the development half: docs/results.md, "KVzip's byte
# target on hybrid models").
BYTES_SLIDING_SCALE = 10.0
# The byte plan's int4 on a hybrid model: 8 exact newest tokens per layer, not 32. The exact residual costs about
# three times an int4 pair in every layer; on Gemma-3-270M at an eighth 32 of them held 40% of the 80 sliding tokens,
# and spent on full-attention pairs instead they kept 18 of 20 development answers where 32 kept 14 (a quarter: 19
# and 19). On SmolLM2 (no sliding layers) 8 kept 4 of 8 development multi_needle answers at a quarter where 32 kept 6
# (an eighth: 5 and 5), so a model without sliding layers keeps BYTES_CODEC_WITHOUT_SLIDING (docs/results.md, "The
# byte plan's exact residual of 8 tokens").
BYTES_SLIDING_CODEC = IntNCodec(bits=4, residual_length=8, **PLAIN_NAME_DEFAULTS[4])  # `int4:residual_length=8`
BYTES_CODEC_WITHOUT_SLIDING = IntNCodec(bits=4, residual_length=32, **PLAIN_NAME_DEFAULTS[4])  # `..._length=32`
# A plain KVzip ratio below this (no codec) is planned as its byte target (`ratio_as_bytes`) on every layout; from it
# up, by the ratio's own rule (`SlidingShare` on a hybrid model). On the development halves (2,000 tokens) the byte
# plan kept at least the ratio's answers per task at a quarter and an eighth: more on Gemma-3-270M, on SmolLM2 the
# same needle and multi_question answers and one multi_needle answer more at each. At a half Gemma-3 lost one
# multi_needle answer (a distractor's number, as every int4 cache there); SmolLM2's half was measured on needle only
# (docs/results.md, "A plain KVzip ratio below a half on Gemma-3 is a byte target" and "... on SmolLM2 too"). The
# int4 pairs decode through the C++ kernel where they lie (head_store.py `attend_encoded`); without it (GPU, no
# compiler) each step decodes them whole, slower than exact pairs (docs/speed.md).
RATIO_BYTES_BELOW = 0.5
# A plain KVzip ratio below RATIO_BYTES_BELOW with the plain `int4` (`kvzip:ratio=0.25+int4`) on a model without
# sliding-window layers is planned as the byte target of the bytes its pairs take in int4 (`ratio_as_bytes`,
# `ratio_codec_share`, R x 5/16 of the bf16 bytes), in the byte plan's layout: on SmolLM2's development half at 2,000
# tokens it kept the ratio's plan's answers in 0.078 of the bytes instead of 0.100. A hybrid model keeps the ratio's
# plan: on Gemma-3-270M's development half the byte target at R x 5/16 (0.078 against the plan's 0.107) kept one
# multi_needle answer more and three needle answers fewer (misread digits). int8, int3 and int2 keep the ratio's plan
# on every model: the byte plan stores in int4, so it would change the precision the user asked for, and spent on
# full-attention pairs in int8, int3 or int2 at an eighth of the bytes Gemma-3 kept fewer answers than in int4
# (docs/results.md, "`kvzip:ratio=R+int4` below a half in the byte plan's layout" and "Gemma-3's multi_needle at
# about an eighth of the bytes").
PLAIN_INT4 = IntNCodec(bits=4, **PLAIN_NAME_DEFAULTS[4])  # what the spec `int4` names


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer of a `CompressedCache` is built from (`CompressedLayer`'s arguments).

    `window`: the layer's `sliding_window` or `attention_chunk_size` (None: full attention). `attention_window`:
    how far back a query sees, for the layer's own mask (sliding_attention layers only). `inv_freq`: RoPE
    frequencies of StreamingLLM's re-rotation (rerotate); `query_inv_freq`: those a policy that keeps queries
    undoes their rotation with (empty: the model does not rotate them). `probe`: the layer's score probe, for a
    policy that scores tokens from their hidden states (KVzap).
    """

    index: int
    layer_type: str
    policy: Policy
    codec: Codec  # bound to the model and numbered for this layer (`for_layer`)
    window: int | None = None
    attention_window: int | None = None
    inv_freq: torch.Tensor | None = field(default=None, compare=False, repr=False)
    query_inv_freq: torch.Tensor | None = field(default=None, compare=False, repr=False)
    probe: object | None = field(default=None, compare=False, repr=False)  # KVzap's score probe (probes.py)
    sliding_share: SlidingShare | None = None  # full-attention layers: what the sliding layers give up to them
    byte_target: ByteTarget | None = None  # full-attention layers under KVzip's bytes=: the bytes the cache holds
    # Sliding layers of a planned share (a plain ratio or bytes=): the newest tokens the plan gave them; a saved cache
    # records it so it loads as it was built (persist.py), whatever the planning rule is then.
    planned_kept: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.layer_type in SLIDING_LAYER_TYPES


@dataclass(frozen=True)
class SlidingShare:
    """How a plain ratio shares a hybrid model's pairs (a policy scored by KVzip's pass, `plans_sliding_share`).

    Each sliding layer keeps its `kept` newest tokens, fewer than the ratio's share ceil(ratio x min(seen, held)) of
    what it holds uncompressed (`held` = window - 1); each full-attention layer keeps, per KV head, the ratio's share
    of the tokens seen plus `extra`: its part of the pairs the sliding layers gave up. So the cache holds the ratio of
    its uncompressed pairs, as a ratio promises, with more of them where the model retrieves from far back. Pairs
    are counted per token and layer: every layer of the models this plans has the same KV heads and head_dim (one
    `num_key_value_heads` and `head_dim` per config). The full-attention layers never get more than they hold (the
    cache then holds less than the ratio), nor fewer than the ratio's share (a document shorter than about
    kept / ratio tokens: its sliding layers keep more than the share)."""

    ratio: float
    kept: int
    held: int
    sliding_layers: int
    full_layers: int
    # (layer index, share of the document): what a full-attention layer keeps at least per KV head at the ranking,
    # from KVzip's calibrated layer floors (`layer_floors`); the ranking of every pair shares out the rest.
    floors: tuple[tuple[int, float], ...] = ()

    def floor_count(self, layer: int, real_seen: torch.Tensor) -> torch.Tensor | None:
        """[B] pairs per KV head layer `layer` keeps at least, ceil(floor x `real_seen` [B]); None without a floor."""
        share = dict(self.floors).get(layer)
        if not share:
            return None
        return torch.minimum(torch.ceil(real_seen.double() * share).long(), real_seen)

    def extra(self, real_seen: torch.Tensor, full_share: torch.Tensor) -> torch.Tensor:
        """[B] tokens per KV head each full-attention layer keeps beyond `full_share` [B] (the policy's share of the
        `real_seen` [B] tokens each row has seen)."""
        held = real_seen.clamp(max=self.held)
        share = torch.ceil(held.double() * self.ratio).long()
        freed = (share - held.clamp(max=self.kept)).clamp(min=0) * self.sliding_layers
        extra = torch.div(freed, self.full_layers, rounding_mode="floor")
        return torch.minimum(extra, real_seen - full_share).clamp(min=0)


@dataclass(frozen=True)
class ByteTarget:
    """KVzip's `bytes=B`: the cache holds B of the bytes transformers' own cache would hold for the same tokens.

    `served`: the dtype the bytes are counted in (the config's 16-bit dtype, else bfloat16; the eval counts the
    same, `budget.served_dtype`). `token_bytes` and `held`, per decoder layer: the bytes one token's keys and
    values take there uncompressed (KV heads x (head_dim + head_dim) x the served width) and the tokens
    transformers' layer holds at most (a sliding layer's window - 1; None: every token). The sliding layers keep
    their planned newest tokens (`byte_sliding_tokens`) in BYTES_SLIDING_CODEC (`byte_codecs`); at the ranking the
    full-attention layers keep the best pairs whose bytes fit in what is left (`spendable`; caches/head_ranking.py
    counts each pair's)."""

    share: float
    served: torch.dtype
    token_bytes: tuple[int, ...]
    held: tuple[int | None, ...]

    def uncompressed(self, real_seen: torch.Tensor) -> torch.Tensor:
        """[B] bytes transformers' cache holds for rows that have seen `real_seen` [B] real tokens."""
        total = torch.zeros_like(real_seen)
        for size, held in zip(self.token_bytes, self.held, strict=True):
            total = total + size * (real_seen if held is None else real_seen.clamp(max=held))
        return total

    def spendable(self, real_seen: torch.Tensor, spent: torch.Tensor) -> torch.Tensor:
        """[B] bytes the ranked layers' pairs may take: B of the uncompressed bytes, less `spent` [B] (what the
        other layers and the ranked layers' own counts hold), never below 0."""
        return (torch.floor(self.uncompressed(real_seen).double() * self.share).long() - spent).clamp(min=0)


def served_head(config) -> tuple[int, torch.dtype]:
    """(head_dim, the dtype the model is served in: its config's 16-bit dtype, else bfloat16, as the eval counts,
    `budget.served_dtype`) of the model of `config`: what a byte share (`ByteTarget`, `ratio_codec_share`) counts in."""
    decoder = text_config(config)
    head_dim = getattr(decoder, "head_dim", None) or decoder.hidden_size // decoder.num_attention_heads
    return head_dim, getattr(torch, served_dtype(getattr(decoder, "dtype", None), getattr(config, "dtype", None))[0])


def byte_target(policy: Policy, config, layer_types: list[str], windows: dict[str, int]) -> ByteTarget | None:
    """The `ByteTarget` of a policy with KVzip's `bytes=` (None for any other policy)."""
    share = getattr(policy, "bytes", None)
    if share is None:
        return None
    decoder = text_config(config)
    kv_heads = getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads
    head_dim, served = served_head(config)
    held = tuple(max(windows[t] - 1, 1) if t == "sliding_attention" else None for t in layer_types)
    return ByteTarget(share, served, (kv_heads * 2 * head_dim * served.itemsize,) * len(layer_types), held)


def ratio_as_bytes(policy: Policy, codec: Codec, config) -> tuple[Policy, Codec]:
    """(`policy`, `codec`) as the plan runs them on the model of `config`. A plain ratio R below RATIO_BYTES_BELOW
    of a policy that takes a byte target (KVzip's, `Policy.with_byte_share`) is planned as a byte target:

    - with no codec, as `bytes=R`: R of the uncompressed bytes in the dtype served, in the byte plan (`ByteTarget`,
      `byte_codecs`: every layer in `byte_plan_codec`, and on a hybrid model `byte_sliding_tokens`): about three
      times as many pairs, each in int4, for the same bytes, which kept more answers than the ratio's exact pairs on
      both layouts (RATIO_BYTES_BELOW's measurements);
    - with the plain `int4` on a model without sliding-window layers (see PLAIN_INT4), as a plain `bytes=` of
      the bytes R of the pairs take in int4 (`ratio_codec_share`: R x int4's bytes per value / the served
      dtype's), in that same byte plan: the byte plan's int4 is the user's int4 with the byte plan's exact residual
      (32 newest tokens) in place of its 128, and the returned codec is the identity, as a plain `bytes=` has.

    Any other policy, a ratio from RATIO_BYTES_BELOW up, any other codec (int8, int3, int2, or an int4 with options
    of its own), the plain `int4` on a model with sliding-window layers (see PLAIN_INT4), a ratio with a knob
    of its own plan (`sliding=`, `floors=`, `budgets=`), or no config: (`policy`, `codec`) as they are."""
    if policy.ratio is None or policy.ratio >= RATIO_BYTES_BELOW or config is None:
        return policy, codec
    if codec.lossless:
        return policy.with_byte_share(policy.ratio) or policy, codec
    windowed = any(t in SLIDING_LAYER_TYPES for t in config_layer_types(config))
    if codec == PLAIN_INT4 and not windowed:
        planned = policy.with_byte_share(ratio_codec_share(policy.ratio, codec, config))
        if planned is not None:
            return planned, IdentityCodec()
    return policy, codec


def ratio_codec_share(ratio: float, codec: Codec, config) -> float:
    """The share of the uncompressed bytes `ratio` of the pairs take in `codec` (before its exact residual, scores
    and sinks): ratio x the codec's bytes per key and value / those of the dtype served, on the model of `config`.
    For `int4` (packed 4-bit codes, a bfloat16 scale and zero per 32 values: 0.625 bytes a value, against 2)
    ratio x 5 / 16 on every model, e.g. 0.078125 at a quarter: the bytes the ratio's own plan holds on documents
    long enough that its 128 exact newest tokens are a small part of the pairs it keeps (more on short ones:
    docs/results.md, "`kvzip:ratio=R+int4` below a half in the byte plan's layout")."""
    head_dim, served = served_head(config)
    rate = codec.bytes_per_token(head_dim, "key", served) + codec.bytes_per_token(head_dim, "value", served)
    return ratio * rate / (2 * head_dim * served.itemsize)


def layer_floors(policy: Policy, config, ratio: float) -> tuple[tuple[int, float], ...]:
    """KVzip's and KVzap's per-layer floors at `ratio` (`SlidingShare.floors`; the policies whose cache ranks every
    layer's pairs at once): from the file its `floors=` names, else the one shipped for the model (none shipped, or
    `floors=none`: no floors). A file holds floors at a few ratios (floor_calibration.py); a ratio takes those of the
    calibrated ratio nearest it on a log scale."""
    source = getattr(policy, "floors", None)
    if source == "none" or not (policy.scores_by_reconstruction or policy.ranks_prompt):
        return ()
    path = floors_file(source, config)
    if path is None:
        return ()
    ratios, layers, floors = load_floors(path, config)
    nearest = int((ratios.log() - math.log(ratio)).abs().argmin())
    return tuple((int(layer), float(floor)) for layer, floor in zip(layers, floors[nearest], strict=True) if floor > 0)


def is_hybrid(layer_types: list[str]) -> bool:
    """Whether a model of these layer types mixes sliding_attention layers with full-attention ones."""
    return "sliding_attention" in layer_types and any(t not in SLIDING_LAYER_TYPES for t in layer_types)


def plans_sliding_share(policy: Policy, layer_types: list[str]) -> bool:
    """Whether `plan_layers` shares the pairs of `policy` between sliding and full-attention layers (`SlidingShare`):
    a ratio with no `sliding=` of a policy whose cache ranks every layer's pairs at once (KVzip at its
    reconstruction pass's end, compressed.py `end_reconstruction`; KVzap's head budgets once the prompt is read,
    `rank_prompt`), on a model with sliding_attention and full-attention layers."""
    ranks_all = policy.scores_by_reconstruction or policy.ranks_prompt
    return ranks_all and planned_share(policy) is not None and policy.sliding is None and is_hybrid(layer_types)


def plans_budget_share(policy: Policy, layer_types: list[str]) -> bool:
    """Whether `plan_layers` shares a `budget` of `policy` between sliding and full-attention layers: KVzap's head
    budgets (`policy.ranks_prompt`: the ranked layers hold one allowance while decoding, head_store.py
    `RankedTogether`) on a model with sliding_attention and full-attention layers. Each sliding layer keeps
    `budget_sliding_tokens` newest tokens and the full-attention layers the budget's allowance those leave
    (`budget_full_tokens`). KVzip's budgets are not planned so (not measured)."""
    return policy.ranks_prompt and policy.budget is not None and is_hybrid(layer_types)


def budget_sliding_tokens(policy: Policy, whole: int) -> int:
    """The newest tokens a sliding layer keeps under a planned budget (`plans_budget_share`) of a window holding
    `whole` (window - 1): `sliding=N` if given, else BUDGET_SLIDING_SHARE's planned share of the window, never more
    than the budget."""
    assert policy.budget is not None  # planned: a budget
    if policy.sliding is not None:
        return policy.sliding
    return min(policy.budget, planned_sliding_tokens(BUDGET_SLIDING_SHARE, whole))


def budget_full_tokens(budget: int, whole: int, kept: int, sliding_layers: int, full_layers: int) -> int:
    """Tokens per KV head a full-attention layer keeps under a planned budget (`plans_budget_share`): the `budget`
    plus its part of what the `sliding_layers` leave of their allowance, min(budget, whole) (a sliding layer holds
    at most `whole`, its window - 1) less the `kept` they keep. So the cache never holds more pairs than the same budget
    in every layer (each capped at what it can hold) would, as a ratio's plan holds the ratio's bytes (`SlidingShare`),
    with more of them where the model retrieves from far back."""
    freed = max(min(budget, whole) - kept, 0) * sliding_layers
    return budget + freed // full_layers


def planned_share(policy: Policy) -> float | None:
    """The share a plan shares between sliding and full-attention layers: a ratio, or KVzip's `bytes`."""
    return policy.ratio if policy.ratio is not None else getattr(policy, "bytes", None)


def sliding_kept(policy: Policy, layer_type: str, window: int, planned: bool = False) -> int | None:
    """Tokens a sliding-window layer keeps under `policy` when that is fewer than transformers' `window - 1`
    (None: the whole window).

    A budget or ratio means the same in every layer: a `budget` of B keeps B tokens per KV head, a `ratio` r keeps
    r of what the layer holds uncompressed (the newest ceil(r x (window - 1)) once the prompt is longer than the
    window), so the cache's bytes follow the ratio on hybrid models too (a planned KVzap budget keeps
    `budget_sliding_tokens`). A sliding layer keeps its newest tokens:
    it attends locally, and KVzip's reconstruction queries, a window away, cannot score it. Chunked-attention
    layers keep their chunk. A policy's `sliding=N` sets the count itself (`dynamic:sliding=127` shrinks only the
    sliding layers; what such counts keep is measured in docs/results.md). `planned` (`plans_sliding_share`): a
    ratio r keeps `planned_sliding_share(r)` of its window (r x r from a half up, less below; KVzip
    `kvzip_sliding_share(r)`, 1.5 x r x r from a half up), but never fewer than
    SLIDING_FLOOR of the window (nor more than the share), and the full-attention layers what that gives up
    (`SlidingShare`): the sliding layers only
    attend locally and their tokens are not scored, while the pairs a full-attention layer needs to answer from far
    back shrink more slowly than the ratio (chosen on Gemma-3-270M's development half, docs/results.md). KVzip's
    `bytes=B` keeps `byte_sliding_tokens(B)` in a cheaper codec (`byte_codecs`)."""
    if layer_type != "sliding_attention":
        return None
    whole = max(window - 1, 1)
    if planned and policy.budget is not None:  # `plans_budget_share`
        kept = budget_sliding_tokens(policy, whole)
    elif policy.sliding is not None:
        kept = policy.sliding
    elif policy.budget is not None:
        kept = policy.budget
    elif planned and getattr(policy, "bytes", None) is not None:
        kept = byte_sliding_tokens(policy.bytes, whole)  # type: ignore[attr-defined]  # KVzip's field: checked
    elif (share := planned_share(policy)) is not None:
        rule = kvzip_sliding_share if policy.scores_by_reconstruction else None
        kept = planned_sliding_tokens(share, whole, rule) if planned else math.ceil(share * whole)
    else:
        return None
    return max(kept, 1) if kept < whole else None


def byte_sliding_tokens(share: float, whole: int) -> int:
    """The newest tokens a sliding layer of `whole` (its window - 1) keeps under KVzip's `bytes=share`:
    ceil(BYTES_SLIDING_SCALE x share x share x whole), at most `whole`, never fewer than SLIDING_FLOOR of it. Falling
    as the square of the share, as a ratio's sliding share does (`planned_sliding_share`): below a quarter the
    full-attention layers need what is left more than the sliding layers need their window. The same for every
    document length: the sliding layers hold at most their window, so the longer the document the larger the
    full-attention layers' part of the bytes."""
    wide = math.ceil(round(BYTES_SLIDING_SCALE * share * share * whole, 9))  # 10 x 0.25^2 x 511 = 319.375 -> 320
    return min(whole, max(wide, math.ceil(SLIDING_FLOOR * whole)))


def byte_plan_codec(layer_types: list[str]) -> Codec:
    """The byte plan's int4 on a model of `layer_types`: BYTES_SLIDING_CODEC on a hybrid model (its sliding layers,
    and a plain bytes='s full-attention layers), BYTES_CODEC_WITHOUT_SLIDING on any other."""
    return BYTES_SLIDING_CODEC if is_hybrid(layer_types) else BYTES_CODEC_WITHOUT_SLIDING


def byte_codecs(policy: Policy, codec: Codec, layer_types: list[str],
                plan_codec: Codec | None = None) -> tuple[Codec, Codec | None]:
    """(the full-attention layers' codec as requested, the sliding layers' codec or None: `codec`'s own) under
    `policy` on a model of `layer_types`. A plain KVzip `bytes=` (no codec) stores the full-attention layers in
    `plan_codec` (None: `byte_plan_codec`'s; persist.py passes a saved cache's own) on every model: exact pairs would
    leave them about B of the document, where answers were lost that three times as many int4 pairs keep (on Gemma-3
    and on SmolLM2, docs/results.md). On a hybrid model `bytes=` also stores the sliding layers' window so, whatever
    the full-attention layers' codec (a wide window in few bytes: the sliding layers attend locally, the answers
    needed them wide, and the full-attention layers need the bytes). Any other policy: unchanged."""
    if getattr(policy, "bytes", None) is None:
        return codec, None
    plan = plan_codec if plan_codec is not None else byte_plan_codec(layer_types)
    full = plan if isinstance(codec, IdentityCodec) else codec
    return full, (plan if is_hybrid(layer_types) else None)


def planned_sliding_tokens(share: float, whole: int, rule: Callable[[float], float] | None = None) -> int:
    """The newest tokens a planned sliding layer keeps of `whole` (its window - 1) at a planned `share`:
    `rule(share)` of them (default `planned_sliding_share`; persist.py passes the rule older files were planned
    by), never fewer than SLIDING_FLOOR of them, never more than the share's own ceil(share x whole)."""
    kept = (rule or planned_sliding_share)(share)
    return min(math.ceil(share * whole), max(math.ceil(kept * whole), math.ceil(SLIDING_FLOOR * whole)))


def planned_sliding_share(ratio: float) -> float:
    """The share of its window a planned sliding layer keeps at `ratio` before SLIDING_FLOOR: r x r of it from a
    half up (r of the ratio's share), 2 x r x r x r below, so that it falls faster than the ratio there and meets
    r x r at a half. On Gemma-3-270M's development half a quarter answered 10 of 11 with 16 sliding tokens (the
    floor) where r x r (32) answered 9, as an eighth had kept more with 16 than with 31 (docs/results.md); a half
    keeps its 128."""
    return ratio * ratio * min(1.0, 2 * ratio)


def kvzip_sliding_share(ratio: float) -> float:
    """KVzip's planned sliding share (`planned_sliding_share` for KVzap): 1.5 x r x r of the window from a half up
    (0.375 at a half: 192 of Gemma-3's 511 tokens), at most r, and 2 x r x r x r below. On Gemma-3-270M's
    multi_needle development half a half answered 9 of 9 with 192, 8 with 128 (its first tenth lost to another
    needle's number even with every full-attention pair kept) and 7 with 256 (the end band's digits lost, the
    full-attention layers keeping half of the document); docs/results.md, "KVzip at a half on Gemma-3: the sliding
    layers' cut". KVzap's plan is unchanged (not measured)."""
    if ratio >= 0.5:
        return min(ratio, 1.5 * ratio * ratio)
    return planned_sliding_share(ratio)


def sliding_layer_codec(codec: Codec, layer_type: str, exact_window: bool = False) -> Codec:
    """How a sliding layer stores keys. Its window evicts, but per-channel key groups (KIVI) only need to lose whole
    groups, which a block window does (policies/block_window.py): keys are grouped as without eviction (per channel
    for int4/int3/int2 and key_axis='channel'), and an explicit key_axis='token' keeps them per token: per-channel
    keys lowered the sliding layers' windowed attention error at every width (docs/results.md). Chunked-attention
    layers, and sliding layers that keep fewer tokens than their window (`exact_window`, see `sliding_kept`), keep
    per-token keys and an exact window: transformers' mask would show the older tokens of a block."""
    if layer_type == "sliding_attention" and not exact_window:
        return resolve_for_policy(codec, False)
    return resolve_for_policy(_keys_per_token(codec), True)


def sliding_layer_policy(codec: Codec, window: int, kept: int | None = None) -> Policy:
    """transformers keeps `window - 1` tokens between steps; so do we, exactly when the codec stores single tokens,
    and dropping whole blocks when it groups keys across tokens (between window - 1 and window - 1 + block - 1).
    `kept` (from `sliding_kept`) keeps that many newest tokens instead, exactly."""
    if kept is not None:
        return SinkWindowPolicy(sink_tokens=0, window=kept)
    kept = max(window - 1, 1)
    block = max(codec.token_block("key"), codec.token_block("value"))
    return BlockWindowPolicy(window=kept, block=block) if block > 1 else SinkWindowPolicy(sink_tokens=0, window=kept)


def _keys_per_token(codec: Codec) -> Codec:
    """`codec` with an explicit key_axis='channel' turned to 'token', also in a reducing codec's storage."""
    if isinstance(codec, ReducingCodec):
        return codec.with_storage(_keys_per_token(codec.storage))
    if getattr(codec, "key_axis", None) == "channel":
        return dataclasses.replace(codec, key_axis="token")  # type: ignore[call-arg]  # a codec with key_axis: checked
    return codec


def cache_codec(policy: Policy, codec: Codec, config) -> Codec:
    """The codec of the full-attention layers before numbering: bound to the model, then set for the policy."""
    return resolve_for_policy(resolve_for_model(codec, config), policy.evicts)


def query_rope(policy: Policy, config) -> torch.Tensor | None:
    """The full-attention layers' RoPE frequencies, for a policy that keeps queries before RoPE (empty: the model
    does not rotate them); None for the other policies."""
    if not policy.needs_queries:
        return None
    if config is None:
        raise ValueError(
            f"{policy.name} needs config=model.config (make_cache(spec, model.config)): it reads the RoPE "
            "frequencies to undo the rotation of the queries it models"
        )
    if getattr(text_config(config), "rope_parameters", None) is None:
        return torch.zeros(0)
    return rope_inv_freq(config, "full_attention")


def check_without_config(policy: Policy, rerotate: bool) -> None:
    """Refuse what a cache built without the model's config cannot plan (its layers are built as they are used)."""
    if rerotate:
        raise ValueError("rerotate=True needs config=model.config (RoPE parameters are read from it)")
    query_rope(policy, None)
    if policy.needs_hidden_states:
        raise ValueError(
            f"{policy.name} needs config=model.config (make_cache(spec, model.config)): its score probe is per model"
        )
    if policy.sliding is not None:
        raise ValueError("sliding= needs config=model.config: it applies to the model's sliding-window layers")
    if getattr(policy, "bytes", None) is not None:
        raise ValueError(
            "bytes= needs config=model.config (make_cache(spec, model.config)): the share is of the bytes the "
            "model's own cache would hold, read from its layers"
        )


def unplanned_layer(policy: Policy, codec: Codec, index: int) -> LayerPlan:
    """The plan of layer `index` of a cache built without a config: full attention, numbered as `plan_layers`
    numbers it (per-layer codecs, such as rotation seeds, match); `codec` is `cache_codec(policy, codec, None)`."""
    return LayerPlan(index, "full_attention", policy, codec.for_layer(index))


def config_layer_types(config) -> list[str]:
    """Each decoder layer's attention type in `config` (full attention where the config lists none)."""
    decoder = text_config(config)
    return getattr(decoder, "layer_types", None) or ["full_attention"] * decoder.num_hidden_layers


def for_model(policy: Policy, config) -> Policy:
    """`policy` with its layout-dependent defaults settled (`Policy.for_layout`) for the model of `config`; without
    a config the layers are built as full attention (`unplanned_layer`), so as for a model without windows."""
    windowed = config is not None and any(t in SLIDING_LAYER_TYPES for t in config_layer_types(config))
    return policy.for_layout(windowed)


def plan_layers(policy: Policy, codec: Codec, config, rerotate: bool = False,
                full_codec: Codec | None = None, share_sliding: bool = True,
                planned_sliding: int | None = None, byte_plan: bool = True,
                ratio_bytes: bool = True, byte_codec: Codec | None = None) -> list[LayerPlan]:
    """Each decoder layer's plan under `policy` x `codec` for the model of `config`.

    `codec` is the codec as requested (unbound); `full_codec` is `cache_codec(policy, codec, config)` when the
    caller has it already (binding may read calibration files). `share_sliding=False` gives a ratio the same share
    in every layer even where `plans_sliding_share` would share it (the plan of caches saved before it existed);
    `planned_sliding`: the tokens a planned sliding layer keeps instead of `sliding_kept`'s (a saved cache's, as it
    was built: persist.py); `byte_plan=False` keeps `codec` in the sliding layers under KVzip's bytes= (no
    `byte_codecs`: caches saved before it existed); `byte_codec`: the byte plan's codec (`byte_codecs`' `plan_codec`,
    None: the layout's; a saved cache's own, persist.py); `ratio_bytes=False` plans a plain ratio by its own rule
    (`SlidingShare`) where `ratio_as_bytes` would make it a byte target (caches saved before that).
    Raises ValueError for what the model cannot store or the policy cannot apply to: a head_dim the codec refuses,
    `sliding=` without sliding layers or past their window.
    """
    if ratio_bytes:
        policy, codec = ratio_as_bytes(policy, codec, config)
    policy = for_model(policy, config)  # the layers run the layout's defaults (the cache's own policy holds them too)
    layer_types = config_layer_types(config)
    codec, sliding_codec = byte_codecs(policy, codec, layer_types, byte_codec) if byte_plan else (codec, None)
    if full_codec is None:
        full_codec = cache_codec(policy, codec, config)
    inv_freq = rope_inv_freq(config, "full_attention") if rerotate else None
    query_inv_freq = query_rope(policy, config)
    probes = load_probes(getattr(policy, "probe", None), config) if policy.needs_hidden_states else {}
    decoder = text_config(config)
    head_dim = getattr(decoder, "head_dim", None) or decoder.hidden_size // decoder.num_attention_heads
    full_codec.check_head_dim(head_dim)  # refuse a codec that cannot store this model now, not mid-generation
    if policy.sliding is not None:
        check_count("sliding", policy.sliding, minimum=1)
        if "sliding_attention" not in layer_types:
            raise ValueError(
                f"sliding={policy.sliding!r} sets what sliding-window layers keep, and this model has none "
                f"(layer types: {sorted(set(layer_types))}); leave sliding unset"
            )
    # The window of each sliding or chunked layer type the model has (transformers reads the same two fields).
    windows: dict[str, int] = {}
    for kind, name in zip(SLIDING_LAYER_TYPES, ("sliding_window", "attention_chunk_size"), strict=True):
        if kind in layer_types:
            window = getattr(decoder, name, None)
            if window is None:
                raise ValueError(f"the config lists {kind} layers but sets no {name}")
            windows[kind] = window
    budget_planned = share_sliding and plans_budget_share(policy, layer_types)
    planned = budget_planned or (share_sliding and plans_sliding_share(policy, layer_types))
    kept = {kind: sliding_kept(policy, kind, window, planned) for kind, window in windows.items()}
    if planned and planned_sliding is not None:
        check_count("planned_sliding", planned_sliding, minimum=1)
        kept["sliding_attention"] = planned_sliding
    target = byte_target(policy, config, layer_types, windows)
    share = None
    full_policy = policy
    if budget_planned and kept["sliding_attention"] is not None:
        assert policy.budget is not None  # `plans_budget_share`: a budget
        # The full-attention layers run the budget plus what the sliding layers leave (their eviction, the
        # ranking's total and the allowance while decoding all read it from the layer's policy).
        full_policy = dataclasses.replace(policy, budget=budget_full_tokens(  # type: ignore[call-arg]  # KVzap's field
            policy.budget, max(windows["sliding_attention"] - 1, 1), kept["sliding_attention"],
            layer_types.count("sliding_attention"), sum(t not in SLIDING_LAYER_TYPES for t in layer_types)))
    elif planned and kept["sliding_attention"] is not None and target is None:
        assert policy.ratio is not None  # planned: a ratio
        share = SlidingShare(policy.ratio, kept["sliding_attention"], max(windows["sliding_attention"] - 1, 1),
                             layer_types.count("sliding_attention"),
                             sum(t not in SLIDING_LAYER_TYPES for t in layer_types),
                             layer_floors(policy, config, policy.ratio))
    if policy.sliding is not None and policy.sliding > windows["sliding_attention"] - 1:
        raise ValueError(
            f"sliding={policy.sliding} is more than this model's sliding layers hold "
            f"({windows['sliding_attention'] - 1}: sliding_window - 1); give 1 to {windows['sliding_attention'] - 1}"
        )
    # Settle key_axis before binding to the model (replace() would drop what binding sets), once per layer type:
    # binding may load calibration files (lowrank).
    sliding_codecs = {
        kind: resolve_for_model(sliding_layer_codec(sliding_codec or codec, kind, kept[kind] is not None), config)
        for kind in kept
    }
    plans = []
    for i, layer_type in enumerate(layer_types):
        if layer_type in SLIDING_LAYER_TYPES:
            window = windows[layer_type]
            layer_codec = sliding_codecs[layer_type]
            plans.append(LayerPlan(
                i, layer_type, sliding_layer_policy(layer_codec, window, kept[layer_type]), layer_codec.for_layer(i),
                window=window, attention_window=window if layer_type == "sliding_attention" else None,
                planned_kept=kept[layer_type] if planned and layer_type == "sliding_attention" else None,
            ))
        else:
            if policy.needs_hidden_states and i not in probes:
                raise ValueError(f"the KVzap probe for this model has no probe for layer {i} ({layer_type})")
            plans.append(LayerPlan(i, layer_type, full_policy, full_codec.for_layer(i), inv_freq=inv_freq,
                                   query_inv_freq=query_inv_freq, probe=probes.get(i), sliding_share=share,
                                   byte_target=target))
    return plans
