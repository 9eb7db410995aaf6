"""RMSNorm and LayerNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: bf16 sums of squares over thousands of channels lose precision.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def build_norm(config: TransformerConfig, dim: int) -> nn.Module:
    norm_cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    norm = norm_cls(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    for param in norm.parameters():
        # Under sequence parallelism each rank normalises its own slice of the sequence, so
        # these replicated weights get partial gradients that are summed over tp.
        param.allreduce_over_tp = config.sequence_parallel
    return norm
