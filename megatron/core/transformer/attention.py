"""Self-attention with GQA, optional QK-norm and RoPE, over one core-attention interface.

Hidden states are sequence-first [s, b, h] as in Megatron, so sequence parallelism can
split the leading dimension. The fused QKV projection is laid out per query group,
[q heads of the group, k, v] for each group, which is what tensor parallelism splits.
The QK-norm normalises each head (`qk_layernorm_scope='head'`, Qwen3) or the whole query and
key projections before the split into heads ('all', OLMoE: `FullWidthNorm`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Tuple

import torch
from functools import partial

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, checkpoint_with_tracker,
                                           divide,
                                           gather_from_sequence_parallel_region, group_rank, group_size)
from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.context_parallel import (gather_keys_and_values, heads_to_sequence,
                                                        sequence_to_heads, whole_sequence_mask)
from megatron.core.transformer.attention_mask import AttentionMask, build_attention_mask
from megatron.core.transformer.init import output_init_std, parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import FullWidthNorm, build_norm
from megatron.core.transformer.rope import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

RotaryPair = Tuple[torch.Tensor, torch.Tensor]


def _norm_whole(norm: FullWidthNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` over the last two dims (heads, head_dim) of x, flattened."""
    return norm(x.reshape(*x.shape[:-2], -1)).view(x.shape)


class SelfAttention(MegatronModule):
    """Self-attention over the query heads of this tensor-parallel rank.

    Up to tp == kv heads, QKV is one column-parallel projection split by query group. With
    more ranks than kv heads, queries are split by head and the K/V rows are split evenly,
    then all-gathered so each rank reads its group's K and V: no weight is stored twice.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 0,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = pg.tp if pg is not None else None
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        self.heads_per_group = self.num_heads // self.num_groups
        self.local_heads = divide(self.num_heads, self.tp_size, "num_attention_heads over tensor-parallel ranks")
        self.split_kv_rows = self.num_groups % self.tp_size != 0
        self._build_projections(config)
        out_kwargs = dict(tp_group=self.tp_group, bias=config.add_bias_linear,
                          sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                          fp32_weight_grad=config.gradient_accumulation_fusion)
        self.linear_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size,
                                             init_std=output_init_std(config),
                                             init_seed=parameter_seed(layer_number, "linear_proj"), **out_kwargs)
        self.q_layernorm = self.k_layernorm = None
        self.full_width_qk_norm = config.qk_layernorm and config.qk_layernorm_scope == "all"
        if self.full_width_qk_norm:
            self.q_layernorm, self.k_layernorm = self._full_width_norms(config)
        elif config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = build_norm(config, self.head_dim), build_norm(config, self.head_dim)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                # Shared by every head (weight and, for LayerNorm, bias), but each rank sees only
                # its own heads: partial gradients.
                param.allreduce_over_tp = self.tp_size > 1
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.cp_group = getattr(pg, "cp", None)
        """Context parallelism: the queries are this rank's, the keys and values are gathered."""
        self.rng_tracker = getattr(pg, "rng_tracker", None)
        """With tensor parallelism (a ParallelContext from GPTModel): each rank holds other heads, so
        attention dropout draws the tracker's per-tp-rank stream."""

    def _build_projections(self, config: TransformerConfig) -> None:
        groups, per_group, dim, hidden = self.num_groups, self.heads_per_group, self.head_dim, config.hidden_size
        kwargs = dict(tp_group=self.tp_group, bias=config.add_bias_linear or config.add_qkv_bias,
                      sequence_parallel=config.sequence_parallel, init_std=config.init_method_std,
                      init_seed=parameter_seed(self.layer_number, "linear_qkv"), params_dtype=config.params_dtype,
                      fp32_weight_grad=config.gradient_accumulation_fusion)
        if not self.split_kv_rows:
            self.local_groups = groups // self.tp_size
            self.linear_qkv = ColumnParallelLinear(hidden, groups * (per_group + 2) * dim,
                                                   output_view=(groups, per_group + 2, dim), **kwargs)
            return
        # tp > kv heads: the same master weight as the fused projection, cut differently.
        self.replicas = self.tp_size // groups
        self.group_index = self.tp_rank // self.replicas
        self.local_groups = 1
        self.linear_q = ColumnParallelLinear(hidden, self.num_heads * dim, **kwargs)
        self.linear_kv = ColumnParallelLinear(hidden, groups * 2 * dim, **kwargs)
        fused = ColumnParallelLinear(hidden, groups * (per_group + 2) * dim, **(kwargs | {"tp_group": None}))
        with torch.no_grad():
            for name in ("weight", "bias"):
                full = getattr(fused, name)
                if full is None:
                    continue
                viewed = full.view(groups, per_group + 2, dim, *full.shape[1:])
                getattr(self.linear_q, name).copy_(self._local_rows(viewed[:, :per_group], self.linear_q))
                getattr(self.linear_kv, name).copy_(self._local_rows(viewed[:, per_group:], self.linear_kv))

    def _full_width_norms(self, config: TransformerConfig) -> Tuple[FullWidthNorm, FullWidthNorm]:
        """The query norm is split like the query heads (a rank's heads are consecutive in the global
        order); the key norm like the kv groups, or, when tp > kv heads (every rank gathers all the
        keys and normalises them), whole on every rank."""
        dim, group = self.head_dim, self.tp_group if self.tp_size > 1 else None
        query = FullWidthNorm(config, self.local_heads * dim, self.num_heads * dim,
                              self.tp_rank * self.local_heads * dim, group)
        if self.split_kv_rows:
            key = FullWidthNorm(config, self.num_groups * dim, self.num_groups * dim, 0,
                                partial_grads=self.tp_size > 1)
        else:
            key = FullWidthNorm(config, self.local_groups * dim, self.num_groups * dim,
                                self.tp_rank * self.local_groups * dim, group)
        return query, key

    def _local_rows(self, viewed: torch.Tensor, layer: ColumnParallelLinear) -> torch.Tensor:
        rows = viewed.reshape(-1, *viewed.shape[3:])
        size = layer.output_size_per_partition
        return rows[self.tp_rank * size:(self.tp_rank + 1) * size]

    def get_query_key_value(self, hidden_states: torch.Tensor):
        """[s, b, h] (or [s/tp, b, h] under SP) -> q [b, local heads, s, d], k and v [b, local groups, s, d]."""
        if self.split_kv_rows:
            query = self.linear_q(hidden_states)
            seq, batch = query.shape[:2]
            query = query.view(seq, batch, self.local_heads, self.head_dim)
            key_value = self.linear_kv(hidden_states)
            # All-gather the K/V rows; the backward sums the grads of the ranks sharing a group.
            key_value = gather_from_sequence_parallel_region(key_value.permute(2, 0, 1).contiguous(), self.tp_group)
            key_value = key_value.permute(1, 2, 0).view(seq, batch, self.num_groups, 2, self.head_dim)
            key, value = key_value.unbind(3)
            if self.full_width_qk_norm:  # every group's key is here: the full width, no reduction
                key = _norm_whole(self.k_layernorm, key)
            key, value = (tensor[:, :, self.group_index:self.group_index + 1] for tensor in (key, value))
        else:
            mixed = self.linear_qkv(hidden_states)
            seq, batch = mixed.shape[:2]
            mixed = mixed.view(seq, batch, self.local_groups, self.heads_per_group + 2, self.head_dim)
            query, key, value = mixed.split([self.heads_per_group, 1, 1], dim=3)
            query = query.reshape(seq, batch, self.local_heads, self.head_dim)
            key, value = key.squeeze(3), value.squeeze(3)
        if self.full_width_qk_norm:
            query = _norm_whole(self.q_layernorm, query)
            key = key if self.split_kv_rows else _norm_whole(self.k_layernorm, key)
        elif self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        # [s, b, n, d] -> [b, n, s, d], the layout of every core-attention backend.
        return query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)

    def _core_attention(self, query, key, value, attention_mask: AttentionMask) -> torch.Tensor:
        dropout = self.config.attention_dropout if self.training else 0.0
        # Each tp rank holds other heads, so their dropout masks must differ.
        stream = self.rng_tracker.fork() if dropout > 0 and self.rng_tracker is not None else nullcontext()
        with stream:
            return core_attention(query, key, value, attention_mask, backend=self.config.attention_backend,
                                  dropout_p=dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMask,
                rotary_pos_emb: Optional[RotaryPair] = None, kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        """``kv_cache`` (generation): this layer's handle, an object with ``update(start, key,
        value) -> (keys, values)`` (megatron.core.inference.generation.LayerCache, keyed by the
        global layer index, so a pipeline stage's slice uses its own slots). This layer's k/v
        (after k-norm and RoPE) are written at positions ``[cache_start, cache_start + s)`` and
        the queries attend the whole returned buffer under ``attention_mask`` (an explicit mask)."""
        query, key, value = self.get_query_key_value(hidden_states)
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            query, key = apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
        ulysses = kv_cache is None and group_size(self.cp_group) > 1 and self.config.cp_comm_type == "a2a"
        if kv_cache is not None:
            key, value = kv_cache.update(cache_start, key, value)
        elif ulysses:  # context parallelism: 1/C of the heads over the whole sequence
            query, key, value = sequence_to_heads(query, key, value, self.cp_group)
            attention_mask = whole_sequence_mask(attention_mask)
        else:  # context parallelism: this rank's queries against every key
            key, value = gather_keys_and_values(key, value, self.cp_group)
        if self.recompute_core_attention and torch.is_grad_enabled():
            # Selective recompute: the attention internals are cheap to redo and large to keep.
            context = checkpoint_with_tracker(partial(self._core_attention, attention_mask=attention_mask),
                                              self.rng_tracker, query, key, value)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        if ulysses:
            context = heads_to_sequence(context, self.cp_group)
        batch, heads, seq, dim = context.shape
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)
        return self.linear_proj(context)

    def sharded_state_dict(self, prefix: str = ""):
        if not self.split_kv_rows:
            return super().sharded_state_dict(prefix)
        sharded = {key: value for key, value in super().sharded_state_dict(prefix).items()
                   if not key.startswith((f"{prefix}linear_q.", f"{prefix}linear_kv."))}
        sharded.update(self._split_qkv_shards(prefix))
        return sharded

    def _split_qkv_shards(self, prefix: str):
        """The q and k/v rows of this rank as boxes of the fused (groups, heads + 2, d, ...) tensor."""
        per_group, dim, replica = self.heads_per_group, self.head_dim, self.tp_rank % self.replicas
        q_heads = per_group // self.replicas
        kv_rows = 2 * dim // self.replicas
        kv_slot, kv_offset = divmod(replica * kv_rows, dim)
        shards = {}
        for name in ("weight", "bias"):
            q, kv = getattr(self.linear_q, name), getattr(self.linear_kv, name)
            if q is None:
                continue
            tail = tuple(q.shape[1:])
            key = f"{prefix}linear_qkv.{name}"
            global_shape = (self.num_groups, per_group + 2, dim, *tail)
            shards[key] = ShardedTensor(key, q.detach().view(1, q_heads, dim, *tail), global_shape,
                                        (self.group_index, replica * q_heads, 0, *[0] * len(tail)))
            shards[f"{key}:kv"] = ShardedTensor(key, kv.detach().view(1, 1, kv_rows, *tail), global_shape,
                                                (self.group_index, per_group + kv_slot, kv_offset,
                                                 *[0] * len(tail)))
        return shards


class DiffLMSelfAttention(SelfAttention):
    """Self-attention whose default mask is the diffusion objective's mask.

    The projections are those of `SelfAttention`; only the mask handling differs: without
    an explicit mask it attends with the DLMConfig's mask type for its running mode
    (bidirectional, block-causal, sliding window; causal in the vanilla mode).
    """

    def __init__(self, config: TransformerConfig, dlm_config: DLMConfig, layer_number: int = 0,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config, layer_number, pg)
        self.dlm_config = dlm_config

    def default_attention_mask(self, document_ids: Optional[torch.Tensor] = None) -> AttentionMask:
        return build_attention_mask(self.config, self.dlm_config, document_ids)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[AttentionMask] = None,
                rotary_pos_emb: Optional[RotaryPair] = None, kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = self.default_attention_mask()
        return super().forward(hidden_states, attention_mask, rotary_pos_emb, kv_cache, cache_start)


# The name MegaDLMs users look for.
