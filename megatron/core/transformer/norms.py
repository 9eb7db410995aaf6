"""RMSNorm and LayerNorm, computed in fp32 whatever the activation dtype, and `FullWidthNorm`,
the query/key norm over a whole (tensor-parallel) projection."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import all_reduce_with_partial_grads
from megatron.core.transformer.transformer_config import TransformerConfig


def _scale(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """The fp32 scale a norm multiplies by: its weight, or 1 + weight when zero-centred."""
    return weight.float() + 1.0 if zero_centered else weight.float()


class RMSNorm(nn.Module):
    """Plain tensor math: under --torch-compile Inductor fuses it with its neighbours (a hand-written
    kernel measured slower, docs/performance.md)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.full((dim,), 0.0 if zero_centered_gamma else 1.0, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: bf16 sums of squares over thousands of channels lose precision.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * _scale(self.weight, self.zero_centered_gamma)).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.full((dim,), 0.0 if zero_centered_gamma else 1.0, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = _scale(self.weight, self.zero_centered_gamma)
        out = nn.functional.layer_norm(x.float(), (x.shape[-1],), scale, self.bias.float(), self.eps)
        return out.to(x.dtype)


def build_norm(config: TransformerConfig, dim: int) -> nn.Module:
    if config.normalization == "RMSNorm":
        norm = RMSNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype,
                       zero_centered_gamma=config.layernorm_zero_centered_gamma)
    else:
        norm = LayerNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype,
                         zero_centered_gamma=config.layernorm_zero_centered_gamma)
    for param in norm.parameters():
        # Under sequence parallelism each rank normalises its own slice of the sequence, so
        # these replicated weights get partial gradients that are summed over tp.
        param.allreduce_over_tp = config.sequence_parallel
    return norm


class FullWidthNorm(nn.Module):
    """RMSNorm / LayerNorm over a whole query (or key) projection, heads x head_dim channels, before
    the split into heads (`qk_layernorm_scope='all'`, OLMoE and OLMo2), with a weight of that width.

    This rank holds `width` of the `global_width` channels, at `offset` of the global order (the
    HF q_proj / k_proj row order: head-major, which is the fused QKV's kv-group-major head order).
    The statistics are summed over `group`, the tp ranks holding the other channels (None: this
    rank has them all), so every rank normalises with the full-width mean square. The weight (and
    bias) is this rank's slice, a tensor-parallel parameter stored as the global [global_width]
    tensor. `partial_grads`: the whole weight is replicated on ranks that each use a part of it.
    """

    def __init__(self, config: TransformerConfig, width: int, global_width: int, offset: int, group=None,
                 partial_grads: bool = False) -> None:
        super().__init__()
        self.eps, self.layer_norm = config.layernorm_epsilon, config.normalization == "LayerNorm"
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.global_width, self.offset, self.group = global_width, offset, group
        self.weight = nn.Parameter(torch.full((width,), 0.0 if self.zero_centered_gamma else 1.0,
                                              dtype=config.params_dtype))
        if self.layer_norm:
            self.bias = nn.Parameter(torch.zeros(width, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            set_tensor_model_parallel_attributes(param, 0 if width < global_width else None)
            param.allreduce_over_tp = partial_grads

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_with_partial_grads(x.sum(-1, keepdim=True), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # fp32 statistics, as the per-head norms
        if self.layer_norm:
            x32 = x32 - self._sum(x32) / self.global_width
        normed = x32 * torch.rsqrt(self._sum(x32.pow(2)) / self.global_width + self.eps)
        normed = normed * _scale(self.weight, self.zero_centered_gamma)
        if self.bias is not None:
            normed = normed + self.bias.float()
        return normed.to(x.dtype)

    def sharded_state_dict(self, prefix: str = ""):
        return {f"{prefix}{name}": ShardedTensor(f"{prefix}{name}", param.detach(), (self.global_width,),
                                                 (self.offset,))
                for name, param in self.named_parameters()}
