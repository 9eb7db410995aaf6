"""Self-attention with GQA, optional QK-norm and RoPE, over one core-attention interface.

Hidden states are sequence-first [s, b, h] as in Megatron, so sequence parallelism can
split the leading dimension. The fused QKV projection is laid out per query group,
[q heads of the group, k, v] for each group, which is what tensor parallelism splits.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.mlp import init_linear, output_init_std
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

RotaryPair = Tuple[torch.Tensor, torch.Tensor]


class SelfAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        self.heads_per_group = self.num_heads // self.num_groups
        qkv_out = self.num_groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = init_linear(
            nn.Linear(config.hidden_size, qkv_out, bias=config.add_bias_linear or config.add_qkv_bias,
                      dtype=config.params_dtype), config.init_method_std)
        self.linear_proj = init_linear(
            nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear,
                      dtype=config.params_dtype), output_init_std(config))
        self.q_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        self.recompute_core_attention = config.recompute_granularity == "selective"

    def get_query_key_value(self, hidden_states: torch.Tensor):
        """[s, b, h] -> q [b, heads, s, d], k and v [b, groups, s, d]."""
        seq, batch, _ = hidden_states.shape
        mixed = self.linear_qkv(hidden_states)
        mixed = mixed.view(seq, batch, self.num_groups, self.heads_per_group + 2, self.head_dim)
        query, key, value = mixed.split([self.heads_per_group, 1, 1], dim=3)
        query = query.reshape(seq, batch, self.num_heads, self.head_dim)
        key, value = key.squeeze(3), value.squeeze(3)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        # [s, b, n, d] -> [b, n, s, d], the layout of every core-attention backend.
        return query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)

    def _core_attention(self, query, key, value, attention_mask: AttentionMask) -> torch.Tensor:
        return core_attention(query, key, value, attention_mask, backend=self.config.attention_backend,
                              dropout_p=self.config.attention_dropout if self.training else 0.0)

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMask,
                rotary_pos_emb: Optional[RotaryPair] = None) -> torch.Tensor:
        query, key, value = self.get_query_key_value(hidden_states)
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            query, key = apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
        if self.recompute_core_attention and torch.is_grad_enabled():
            # Selective recompute: the attention internals are cheap to redo and large to keep.
            context = checkpoint(self._core_attention, query, key, value, attention_mask, use_reentrant=False)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        batch, heads, seq, dim = context.shape
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
        return self.linear_proj(context)


class DiffLMSelfAttention(SelfAttention):
    """Self-attention whose default mask is the diffusion objective's mask.

    The projections are those of `SelfAttention`; only the mask handling differs: without
    an explicit mask it attends with the DLMConfig's mask type for its running mode
    (bidirectional, block-causal, sliding window; causal in the vanilla mode).
    """

    def __init__(self, config: TransformerConfig, dlm_config: DLMConfig, layer_number: int = 0) -> None:
        super().__init__(config, layer_number)
        self.dlm_config = dlm_config

    def default_attention_mask(self, document_ids: Optional[torch.Tensor] = None) -> AttentionMask:
        return build_attention_mask(self.config, self.dlm_config, document_ids)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[AttentionMask] = None,
                rotary_pos_emb: Optional[RotaryPair] = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = self.default_attention_mask()
        return super().forward(hidden_states, attention_mask, rotary_pos_emb)


# The name MegaDLMs users look for.
DiffLMAttention = DiffLMSelfAttention


def build_attention_mask(config: TransformerConfig, dlm_config: DLMConfig,
                         document_ids: Optional[torch.Tensor] = None,
                         mask_type: Optional[str] = None) -> AttentionMask:
    """The mask of a running mode: the DLM mask type, or causal for the vanilla (AR) mode."""
    mask_type = mask_type or dlm_config.effective_mask_type
    return AttentionMask(mask_type=mask_type,
                         block_size=dlm_config.block_size if mask_type == "block_causal" else None,
                         window=config.sliding_window if mask_type == "sliding_window" else None,
                         document_ids=document_ids)
