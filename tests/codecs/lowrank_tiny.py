"""The tiny Llama with joint low-rank bases fitted on random ids, shared by the lowrank codec's tests."""

import torch

from hf_kvcompress import use_kvcompress_attention
from hf_kvcompress.calibration import calibrate_joint, save_bases

from ..caches.tiny_models import calibration_model, tiny_model


def llama_with_bases(tmp_path_factory):
    """(model, joint bases dir): 2 layers, 2 KV heads, head_dim 32, the package's attention, bases fitted on 200
    seeded random ids."""
    model = use_kvcompress_attention(tiny_model("llama"))
    model.config._name_or_path = "tiny-llama"
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    tensors, metadata, _ = calibrate_joint(model, ids, text="random ids")
    return model, save_bases(tensors, metadata, tmp_path_factory.mktemp("bases")).parent


def fit_with_errors(family: str, generator: torch.Generator):
    """(model, tensors, metadata, fit ids, held-out ids): `calibration_model(family)` with joint bases fitted on 200
    random ids and error curves on 120 held-out ones, both drawn from `generator` (in that order)."""
    model = calibration_model(family)
    ids = torch.randint(3, 128, (1, 200), generator=generator)
    held = torch.randint(3, 128, (1, 120), generator=generator)
    tensors, metadata, _ = calibrate_joint(model, ids, text="random ids", error_ids=held)
    return model, tensors, metadata, ids, held


def with_bases(bases, spec: str) -> str:
    """`spec` with every `lowrank:` reading the bases in `bases`."""
    return spec.replace("lowrank:", f"lowrank:bases={bases},")
