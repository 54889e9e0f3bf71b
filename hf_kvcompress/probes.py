"""KVzap's score probes (arXiv:2601.07891): per decoder layer, a linear map from the hidden state entering
attention to the log of KVzip's score of each KV head, fitted per model (probe_calibration.py) and shipped in
`calibrations/` as safetensors.

A probe is model weights, not cache storage: one `LinearProbe` per layer is shared by every cache of the model
(`load_probes` is cached), and as a `torch.nn.Module` it is not counted in a cache's bytes (measure.py counts the
tensors a cache owns; modules are the model's).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file

from .calibration import calibration_file, model_identity, read_calibration
from .hf.compat import text_config

PROBE_FILE = "kvzap_probe.safetensors"
PROBE_FORMAT = "hf-kvcompress-kvzap-1"
PACKAGED_SUFFIX = ".kvzap.safetensors"


class LinearProbe(torch.nn.Module):
    """scores = hidden @ weight + bias, in float32: [B, n, hidden] -> [B, H_kv, n]."""

    weight: torch.Tensor  # buffers, declared for the type checker
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.float().contiguous())  # [hidden, H_kv]
        self.register_buffer("bias", bias.float().contiguous())  # [H_kv]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight.device != hidden.device:  # once per device: the probe follows the model it serves
            self.to(hidden.device)
        batch, new, width = hidden.shape
        scores = torch.addmm(self.bias, hidden.reshape(batch * new, width).float(), self.weight)
        if new == 1:  # a decode step: [B, 1, H_kv] and [B, H_kv, 1] lie alike in memory
            return scores.view(batch, -1, 1)
        return scores.reshape(batch, new, -1).transpose(1, 2).contiguous()


def estimated_score(log_scores: torch.Tensor) -> torch.Tensor:
    """What a cache ranks by: p / (1 + p) of the estimated KVzip score p = exp(log_scores). Monotone in p and below
    1, as the attention probabilities KVzip's head ranking and store are built for (head_ranking.py ranks the
    recent window at 1.5 and later tokens from 2), whatever a probe estimates past its training range."""
    return torch.sigmoid(log_scores)


def save_probe(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str | os.PathLike) -> Path:
    """Write the probe to `path` (a directory: PROBE_FILE in it), float32 (a ridge probe is a few hundred kB)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def probe_path(source: str | os.PathLike | None, config) -> Path:
    """The file a policy's `probe=` names (a file, or a directory holding PROBE_FILE; None: the packaged one)."""
    return calibration_file(source, config, file_name=PROBE_FILE, packaged_suffix=PACKAGED_SUFFIX,
                            spec_param="kvzap:probe", what="KVzap probe", command="hf-kvcompress calibrate --probe")


def load_probes(source: str | os.PathLike | None, config) -> dict[int, LinearProbe]:
    """Each probed layer's probe, by layer index, for `config`'s model; refuses a probe fitted for another model
    or shape."""
    path = probe_path(source, config)
    decoder = text_config(config)
    expected = {
        "model": model_identity(config), "layers": str(decoder.num_hidden_layers),
        "kv_heads": str(getattr(decoder, "num_key_value_heads", None) or decoder.num_attention_heads),
        "hidden_size": str(decoder.hidden_size),
    }
    return _read(str(path.resolve()), tuple(sorted(expected.items())))


@lru_cache(maxsize=8)
def _read(path: str, expected: tuple[tuple[str, str], ...]) -> dict[int, LinearProbe]:
    tensors, metadata = read_calibration(Path(path), PROBE_FORMAT, "KVzap probe")
    for key, value in expected:
        if metadata.get(key) != value:
            raise ValueError(
                f"the KVzap probe in {path} was fitted for {key}={metadata.get(key)!r}, this model has "
                f"{key}={value!r}: calibrate this model (hf-kvcompress calibrate --probe --model M --out DIR)"
            )
    layers = [int(i) for i in metadata["probe_layers"].split(",") if i]
    return {i: LinearProbe(tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"]) for i in layers}
