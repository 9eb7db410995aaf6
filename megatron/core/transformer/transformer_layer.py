"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Both sub-blocks are slots: `self_attention` and `mlp` take any module with the call signature of
`SelfAttention` / `MLP` (a mixture-of-experts layer goes into `mlp`); left out, the dense ones
are built from the config (the MLP slot holds an MoE layer where `config.moe` says so).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

from megatron.core.parallel_state import ProcessGroups
from megatron.core.transformer.attention import DiffLMSelfAttention, RotaryPair, SelfAttention
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import build_mlp
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


class TransformerLayer(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0,
                 self_attention: Optional[nn.Module] = None, mlp: Optional[nn.Module] = None,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = self_attention if self_attention is not None else SelfAttention(config, layer_number, pg)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.mlp = mlp if mlp is not None else build_mlp(config, layer_number, pg)
        self.rng_tracker = getattr(pg, "rng_tracker", None) if getattr(pg, "sequence_parallel", False) else None
        """Under sequence parallelism each tp rank holds other tokens: hidden dropout draws the
        tracker's per-tp-rank stream (without SP the activations are replicated: the default one)."""

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.config.hidden_dropout == 0:
            return x
        stream = self.rng_tracker.fork() if self.rng_tracker is not None else nullcontext()
        with stream:
            return nn.functional.dropout(x, p=self.config.hidden_dropout, training=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[AttentionMask] = None,
                rotary_pos_emb: Optional[RotaryPair] = None, kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        """``kv_cache`` / ``cache_start``: generation only, see `SelfAttention.forward`."""
        attn_out = self.self_attention(self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb,
                                       kv_cache=kv_cache, cache_start=cache_start)
        hidden_states = hidden_states + self._dropout(attn_out)
        mlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + self._dropout(mlp_out)


class DiffLMTransformerLayer(TransformerLayer):
    """A transformer layer whose attention defaults to the diffusion mask (DiffLMSelfAttention)."""

    def __init__(self, config: TransformerConfig, dlm_config: DLMConfig, layer_number: int = 0,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config, layer_number, self_attention=DiffLMSelfAttention(config, dlm_config, layer_number, pg),
                         pg=pg)
        self.dlm_config = dlm_config
