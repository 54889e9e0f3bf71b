"""The two worked examples of docs/adding-a-method.md, exactly as the doc shows them.

1. A new policy that scores by attention statistics is one file: flags and `observe` / `score`; the layer asks the
   attention function for the statistics and evicts when they arrive.
2. A new per-slot tensor is one name in `SlotRecords.PER_SLOT`: eviction, beam search, saving, loading and the byte
   count move it with the others (the test adds it in a subclass instead of editing slot_records.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hf_kvcompress import measured_kv_bytes, use_kvcompress_attention
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.caches.layer import CompressedLayer
from hf_kvcompress.caches.requests import OBSERVER_KEY
from hf_kvcompress.caches.slot_records import SlotRecords
from hf_kvcompress.codecs.identity import IdentityCodec
from hf_kvcompress.policies.base import Policy, check_kept_tokens
from hf_kvcompress.policies.sink_window import SinkWindowPolicy

from .tiny_models import tiny_model

# -- 1. a policy that needs attention statistics (docs/adding-a-method.md, "A new policy") ----------------------


@dataclass(frozen=True)
class PeakAttentionPolicy(Policy):
    """Keep the tokens whose strongest attention from any one query so far is highest, plus sinks and recent."""

    name: ClassVar[str] = "peak_attention"

    budget: int | None = None
    recent: int = 8
    sink_tokens: int = 4
    ratio: float | None = None
    needs_attention: ClassVar[bool] = True  # the layer asks attention for statistics and evicts when they arrive
    attention_reduction: ClassVar[str] = "max"  # a step's queries (and a KV group's heads) reduced by max, not sum

    def __post_init__(self):
        check_kept_tokens(self, default_budget=512)

    def observe(self, accumulated: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return torch.maximum(accumulated, attention)  # the running peak instead of H2O's running sum

    def score(self, accumulated, length, keys=None, positions=None, pads=None) -> torch.Tensor:
        return accumulated


def test_a_policy_scored_by_attention_statistics_evicts_when_they_arrive():
    policy = PeakAttentionPolicy(budget=4, recent=1, sink_tokens=1)
    layer = CompressedLayer(policy, IdentityCodec())
    keys, values = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    attn_kwargs = {}  # what transformers hands the layer and then attention
    full_keys, _ = layer.update(keys, values, attn_kwargs)
    assert torch.equal(full_keys, keys) and layer.stored_tokens == 6  # attention sees all, nothing evicted yet
    request = attn_kwargs[OBSERVER_KEY]
    assert request.reduction == "max"
    # Per head: slot 0 (sink) and 5 (recent) stay, then the two best of slots 1-4.
    attention = torch.tensor([[[0.0, 0.9, 0.1, 0.8, 0.2, 0.0], [0.0, 0.1, 0.7, 0.2, 0.6, 0.0]]])
    request.deliver(attention)  # what our attention function does once it has the statistics
    kept = torch.tensor([[[0, 1, 3, 5], [0, 2, 4, 5]]])
    assert torch.equal(layer.tail_keys, keys.gather(2, kept[..., None].expand(-1, -1, -1, 8)))
    assert torch.equal(layer.slots.accumulated, attention.gather(2, kept))
    # A decode step: the new slot starts at 0 and the peak is kept per slot.
    attn_kwargs = {}
    layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), attn_kwargs)
    step = torch.tensor([[[0.5, 0.5, 0.5, 0.5, 0.3], [0.1, 0.1, 0.9, 0.1, 0.2]]])
    attn_kwargs[OBSERVER_KEY].deliver(step)
    assert layer.stored_tokens == 4 and layer.get_seq_length() == 7


def test_a_policy_scored_by_attention_statistics_generates_within_its_budget():
    model = use_kvcompress_attention(tiny_model("llama"))
    policy = PeakAttentionPolicy(budget=12, recent=2, sink_tokens=1)
    cache = CompressedCache(policy, IdentityCodec(), config=model.config)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert cache.get_seq_length() == 25 and all(layer.stored_tokens == 12 for layer in cache.layers)


# -- 2. a new per-slot tensor (docs/adding-a-method.md, "A new per-slot tensor") -----------------------------------


class ArrivalRecords(SlotRecords):
    PER_SLOT = SlotRecords.PER_SLOT + ("arrival",)  # the one line: in slot_records.py, the name in PER_SLOT


class ArrivalLayer(CompressedLayer):
    """Records each slot's token index where the layer appends its new tokens (in the library: `_append_tail`)."""

    def _clear(self) -> None:
        super()._clear()
        self.slots = ArrivalRecords()

    def _append_tail(self, key_states, value_states) -> None:
        super()._append_tail(key_states, value_states)
        new = key_states.shape[-2]
        arrival = torch.arange(self.seen - new, self.seen, device=self.device)
        self.slots.append("arrival", arrival.expand(self.batch_size, self.kv_heads, new).contiguous())


def _arrival_layer(batch: int = 1) -> ArrivalLayer:
    layer = ArrivalLayer(SinkWindowPolicy(sink_tokens=1, window=3), IdentityCodec())
    layer.update(torch.randn(batch, 2, 6, 8), torch.randn(batch, 2, 6, 8), {})
    for _ in range(3):
        layer.update(torch.randn(batch, 2, 1, 8), torch.randn(batch, 2, 1, 8), {})
    return layer


def test_a_new_per_slot_tensor_follows_eviction_rows_saving_and_bytes():
    layer = _arrival_layer()
    # Eviction kept the sink (token 0) and the window (the 3 newest of 9 tokens): the record followed.
    assert layer.slots.arrival.tolist() == [[[0, 6, 7, 8]] * 2]
    assert measured_kv_bytes(layer) == layer.promised_bytes()  # counted with the other records
    tensors, meta = layer.export_state()
    assert torch.equal(tensors["arrival"], layer.slots.arrival)
    loaded = ArrivalLayer(layer.policy, layer.codec)
    loaded.import_state(tensors, meta, "cpu")
    assert torch.equal(loaded.slots.arrival, layer.slots.arrival)
    layer.batch_repeat_interleave(2)
    assert layer.slots.arrival.shape[0] == 2 and torch.equal(layer.slots.arrival[0], layer.slots.arrival[1])


def test_a_new_per_slot_tensor_is_cropped_with_the_others():
    layer = ArrivalLayer(SinkWindowPolicy(sink_tokens=1, window=30), IdentityCodec())
    layer.update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), {})
    layer.crop(-2)
    assert layer.slots.arrival.tolist() == [[[0, 1, 2, 3]] * 2]


def test_slot_records_move_every_record_alike():
    records = ArrivalRecords(accumulated=torch.arange(6.0).view(1, 1, 6), sink_slots=torch.tensor([[[1]]]))
    records.append("arrival", torch.arange(6).view(1, 1, 6))
    records.take(torch.tensor([[[1, 3, 4, 5]]]))
    assert records.arrival.tolist() == [[[1, 3, 4, 5]]] and records.accumulated.tolist() == [[[1.0, 3.0, 4.0, 5.0]]]
    assert records.sink_slots.tolist() == [[[0]]]  # slot 1 is now slot 0
    records.drop(1)
    assert records.arrival.tolist() == [[[3, 4, 5]]] and records.sink_slots.tolist() == [[[-1]]]
    records.crop(2)
    assert records.arrival.tolist() == [[[3, 4]]]
    assert set(records.state()) == {"accumulated", "arrival", "sink_slots"}
    assert records.nbytes() == sum(t.numel() * t.element_size() for t in records.state().values())
