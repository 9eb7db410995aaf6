"""Rotary position embedding (rotate-half convention, as Llama/Qwen/Megatron).

Positions are given per token, so packed documents can restart at 0 and left-padded
prompts can start after their padding. The frequencies may be context-extended
(TransformerConfig.rope_scaling_type: Llama 3.1's scaling or YaRN, rope_scaling.py); YaRN's
attention factor is folded into the cos / sin tables, as Hugging Face and Megatron do.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from megatron.core.transformer.rope_scaling import SCALING_DEFAULTS, inverse_frequencies
from megatron.core.transformer.transformer_config import TransformerConfig


def scaling_settings(config: TransformerConfig) -> dict:
    """The config's RoPE-scaling fields, as rope_scaling.inverse_frequencies (and the export) take them."""
    return {name: getattr(config, name) for name in SCALING_DEFAULTS}


class RotaryEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.rotary_dim = int(config.kv_channels * config.rotary_percent)
        self.max_positions = config.max_position_embeddings
        inv_freq, scale = inverse_frequencies(self.rotary_dim, config.rotary_base, scaling_settings(config))
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Tables are derived from the config, so they are not checkpointed.
        self.register_buffer("cos_table", (angles.cos() * scale).float(), persistent=False)
        self.register_buffer("sin_table", (angles.sin() * scale).float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [b, 1, s, rotary_dim] for q/k in [b, h, s, d]."""
        return self.cos_table[position_ids].unsqueeze(1), self.sin_table[position_ids].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [b, h, s, d]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rotated, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = (rotated.float() * cos + _rotate_half(rotated.float()) * sin).to(x.dtype)
    if passthrough.shape[-1] == 0:
        return rotated
    return torch.cat([rotated, passthrough], dim=-1)
