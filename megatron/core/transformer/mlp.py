"""The feed-forward block: fc1 -> activation (gated: SwiGLU) -> fc2, tensor-parallel."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import triton_swiglu
from megatron.core.transformer.init import output_init_std, parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "relu": nn.functional.relu}


class MLP(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0, pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        tp_group = pg.tp if pg is not None else None
        self.gated = config.gated_linear_unit
        ffn = config.ffn_hidden_size
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, fp32_weight_grad=config.gradient_accumulation_fusion)
        # fc1's output is [gate; up]: each rank holds [gate slice; up slice] (split on dim 1 of (2, ffn)).
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, ffn * (2 if self.gated else 1), init_std=config.init_method_std,
            init_seed=parameter_seed(layer_number, "linear_fc1"),
            output_view=(2, ffn) if self.gated else None, split_dim=1 if self.gated else 0, **common)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, init_std=output_init_std(config),
                                            init_seed=parameter_seed(layer_number, "linear_fc2"), **common)
        self.activation = _ACTIVATIONS[config.activation]
        self.swiglu_kernel = self.gated and config.activation == "silu" and config.bias_swiglu_fusion

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = self.linear_fc1(hidden_states)
        if self.swiglu_kernel and triton_swiglu.available(intermediate):
            intermediate = triton_swiglu.swiglu(intermediate)
        elif self.gated:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = self.activation(gate) * up
        else:
            intermediate = self.activation(intermediate)
        return self.linear_fc2(intermediate)
