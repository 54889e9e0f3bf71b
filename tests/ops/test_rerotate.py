"""Re-rotating RoPE keys equals rotating them at the new position in the first place."""

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_kvcompress.hf.rope import rope_inv_freq
from hf_kvcompress.ops.rerotate import rerotate


def _rotated(config, raw, positions):
    cos, sin = LlamaRotaryEmbedding(config)(raw, positions)
    rotated, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    return rotated


def test_rerotation_moves_keys_to_their_new_positions():
    for rope in ({"rope_type": "default", "rope_theta": 10000.0},
                 {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=rope)
        torch.manual_seed(0)
        raw = torch.randn(1, 2, 5, 32)
        old = torch.tensor([[0, 1, 7, 8, 9]])
        new = torch.tensor([[0, 1, 2, 3, 4]])
        moved = rerotate(_rotated(config, raw, old), (new - old)[:, None, :].expand(1, 2, 5), rope_inv_freq(config))
        assert torch.allclose(moved, _rotated(config, raw, new), atol=1e-5)
