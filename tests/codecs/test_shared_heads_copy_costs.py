"""shared_heads' copy costs: each level's cost is the copy loss's rise with only that level predicted, a ratio spends
by them where the maps hold them (`allocate=copy`), and `allocate=residual` keeps the least-squares order."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from hf_kvcompress import make_cache
from hf_kvcompress.caches.compressed import CompressedCache
from hf_kvcompress.calibration import SHARING_FILE, calibrate_sharing, load_sharing, save_sharing
from hf_kvcompress.codecs.shared_heads import SharedHeadsCodec, has_copy_costs
from hf_kvcompress.copy_weights import copy_loss
from hf_kvcompress.registry import parse_spec
from hf_kvcompress.sharing_costs import add_copy_costs, level_copy_costs

from ..caches.tiny_models import calibration_model

IDS = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
COPY_IDS = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(tiny llama with 2 KV heads and 2 layers, the directory of its maps without copy costs)."""
    model = calibration_model("llama")
    tensors, metadata, _ = calibrate_sharing(model, IDS, text="random ids")
    return model, save_sharing(tensors, metadata, tmp_path_factory.mktemp("sharing")).parent


def with_costs(maps, config, out, costs: dict[str, float]):
    """A copy of `maps` at `out` with `costs` ({tensor name: value}) set."""
    tensors, metadata = load_sharing(maps, config)
    tensors.update({name: torch.tensor(value) for name, value in costs.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / SHARING_FILE), metadata=metadata)
    return out


def test_with_levels_predicts_exactly_the_levels_given(fitted):
    model, maps = fitted
    bound = SharedHeadsCodec(ratio=1.0, maps=str(maps)).reduction_for_model(model.config)
    assert bound.levels() == ((0, 0), (0, 0))
    chosen = bound.with_levels([(0, 1), (1, 0)])
    assert chosen.levels() == ((0, 1), (1, 0)) and bound.levels() == ((0, 0), (0, 0))
    assert chosen.reduction_for_model(model.config) is chosen  # binding again keeps the levels
    policy, _ = parse_spec("shared_heads:ratio=1.0")
    cache = CompressedCache(policy, chosen, config=model.config)
    assert [layer.codec.levels()[i] for i, layer in enumerate(cache.layers)] == [(0, 1), (1, 0)]
    assert cache.layers[0].codec.bytes_per_token(32, "value", torch.float32) == pytest.approx(32 * 4 / 2)
    assert cache.layers[0].codec.bytes_per_token(32, "key", torch.float32) == pytest.approx(32 * 4)
    for bad in ([(0, 0)], [(0, 2), (0, 0)], [(-1, 0), (0, 0)]):
        with pytest.raises(ValueError, match="levels must hold one"):
            bound.with_levels(bad)
    with pytest.raises(ValueError, match="bound to a model"):
        SharedHeadsCodec(ratio=1.0).with_levels([(0, 0), (0, 0)])


def test_copy_costs_are_the_copy_loss_rise_with_that_level_alone(fitted, tmp_path):
    model, maps = fitted
    exact, costs = level_copy_costs(model, COPY_IDS, maps)
    assert exact == pytest.approx(copy_loss(model, COPY_IDS, DynamicCache()))
    assert len(costs) == 2 and all(len(kind) == 1 for pair in costs for kind in pair)  # 2 heads: one level
    # The same level through the public spec: a copy of the maps whose costs make a ratio of 7/8 take it alone.
    others = {f"layers.{i}.{k}.1.cost": 1.0 for i in range(2) for k in ("key", "value")}
    forced = with_costs(maps, model.config, tmp_path / "forced", {**others, "layers.1.value.1.cost": 0.0})
    cache = make_cache(f"shared_heads:ratio=0.875,maps={forced},allocate=residual", model.config)
    assert cache.layers[1].codec.levels() == ((0, 0), (0, 1))
    assert costs[1][1][0] == pytest.approx(copy_loss(model, COPY_IDS, cache) - exact, abs=1e-6)
    assert any(abs(c) > 1e-6 for pair in costs for kind in pair for c in kind)  # predicting heads changes the loss


def test_a_ratio_spends_by_copy_costs_where_the_maps_hold_them(fitted, tmp_path):
    model, maps = fitted
    tensors, metadata = load_sharing(maps, model.config)
    assert not has_copy_costs(tensors)
    add_copy_costs(model, COPY_IDS, maps, tensors, metadata)
    assert has_copy_costs(tensors) and metadata["copy_tokens"] == "48"
    # Residual costs say layer 0's keys first, copy costs say layer 1's values first.
    residual = {f"layers.{i}.{k}.1.cost": 0.5 for i in range(2) for k in ("key", "value")}
    copy = {f"layers.{i}.{k}.1.copy_cost": 0.5 for i in range(2) for k in ("key", "value")}
    out = with_costs(maps, model.config, tmp_path / "both", {**residual, **copy, "layers.0.key.1.cost": 0.0,
                                                             "layers.1.value.1.copy_cost": -0.1})
    spec = f"shared_heads:ratio=0.875,maps={out}"
    assert make_cache(spec, model.config).layers[0].codec.levels() == ((0, 0), (0, 1))  # copy by default
    assert make_cache(spec + ",allocate=copy", model.config).layers[0].codec.levels() == ((0, 0), (0, 1))
    assert make_cache(spec + ",allocate=residual", model.config).layers[0].codec.levels() == ((1, 0), (0, 0))
    assert make_cache(f"shared_heads:ratio=0.875,maps={maps}", model.config).layers[0].codec.levels() is not None
    with pytest.raises(ValueError, match="allocate=copy needs maps with copy costs"):
        make_cache(f"shared_heads:ratio=0.875,maps={maps},allocate=copy", model.config)


def test_measured_maps_must_be_the_saved_ones(fitted):
    model, maps = fitted
    tensors, metadata = load_sharing(maps, model.config)
    tensors["layers.0.key.1.map"] = tensors["layers.0.key.1.map"] + 1
    with pytest.raises(ValueError, match="not the ones given"):
        add_copy_costs(model, COPY_IDS, maps, tensors, metadata)


def test_bad_allocate_names_the_parameter():
    with pytest.raises(ValueError, match="allocate must be one of copy, residual"):
        SharedHeadsCodec(ratio=0.5, allocate="error")
    with pytest.raises(ValueError, match="allocate spreads a ratio"):
        SharedHeadsCodec(allocate="copy")
    codec = SharedHeadsCodec(ratio=0.5, allocate="residual")
    assert "allocate=residual" in codec.spec() and parse_spec(codec.spec())[1] == codec
