"""RoPE frequencies read from a model config, for re-rotating kept keys (the scaling type included)."""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .compat import text_config


def rope_inv_freq(config, layer_type: str | None = None) -> torch.Tensor:
    """The inverse frequencies a model's rotary embedding uses, [rotary_dim / 2]."""
    config = text_config(config)
    params = getattr(config, "rope_parameters", None)
    if params is None:
        raise ValueError(f"{type(config).__name__} has no rope_parameters: this model does not use RoPE")
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        try:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)
        except TypeError:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
