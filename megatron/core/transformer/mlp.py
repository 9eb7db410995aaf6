"""The feed-forward block: fc1 -> activation (gated: SwiGLU) -> fc2, tensor-parallel."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.fusions import fused_swiglu
from megatron.core.transformer.init import output_init_std, parameter_seed
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "relu": nn.functional.relu}


def activate(hidden: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """fc1's output -> fc2's input, for the dense MLP and the experts alike: gated ([gate; up] halves)
    or not; SwiGLU through its Triton kernels where they run and `config.bias_swiglu_fusion` is on."""
    activation = _ACTIVATIONS[config.activation]
    if not config.gated_linear_unit:
        return activation(hidden)
    if fused_swiglu.configured(config) and fused_swiglu.available(hidden):
        return fused_swiglu.swiglu(hidden)
    gate, up = hidden.chunk(2, dim=-1)
    return activation(gate) * up


class MLP(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0, pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        fused_swiglu.register_for(config)
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
        self.fused_forward: Optional[Callable] = None
        """fc1 -> activation -> fc2 as one function, where the precision converter installs one (the float8
        SwiGLU MLP, fp8/float8_mlp.py): called with (hidden, fc1, fc2, config), None where it does not apply."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused_forward is not None:
            fused = self.fused_forward(hidden_states, self.linear_fc1, self.linear_fc2, self.config)
            if fused is not None:
                return fused
        return self.linear_fc2(activate(self.linear_fc1(hidden_states), self.config))
