"""The feed-forward block: fc1 -> activation (gated: SwiGLU) -> fc2."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "relu": nn.functional.relu}


def init_linear(linear: nn.Linear, std: float) -> nn.Linear:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


def output_init_std(config: TransformerConfig) -> float:
    """Projections that write into the residual stream are scaled by 1/sqrt(2 * layers)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class MLP(MegatronModule):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        fc1_out = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        kwargs = dict(bias=config.add_bias_linear, dtype=config.params_dtype)
        self.linear_fc1 = init_linear(nn.Linear(config.hidden_size, fc1_out, **kwargs), config.init_method_std)
        self.linear_fc2 = init_linear(nn.Linear(config.ffn_hidden_size, config.hidden_size, **kwargs),
                                      output_init_std(config))
        self.activation = _ACTIVATIONS[config.activation]
        self.gated = config.gated_linear_unit

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = self.linear_fc1(hidden_states)
        if self.gated:
            # fc1's output is [gate; up]; tensor-parallel fc1 keeps a [gate; up] pair of slices per rank.
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = self.activation(gate) * up
        else:
            intermediate = self.activation(intermediate)
        return self.linear_fc2(intermediate)
