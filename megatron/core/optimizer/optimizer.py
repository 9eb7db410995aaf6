"""AdamW with Megatron's parameter groups, and the gradient clipping of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    """Peak learning rate (the scheduler writes the current one into the groups)."""
    weight_decay: float = 0.01
    """Decoupled weight decay for matrices and embeddings; norms and biases get none."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global L2 norm clip; 0 disables clipping (the norm is still computed and logged)."""


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """Two groups: decayed weights, and norms/biases without decay (1-D parameters)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    # wd_mult tells the LR scheduler, which rewrites weight decay every step, to keep it 0 here.
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, config.weight_decay)
    on_cuda = all(p.is_cuda for group in groups for p in group["params"])
    # The fused kernel updates every parameter in one launch on GPU; foreach elsewhere.
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, weight_decay=config.weight_decay,
                             fused=True if on_cuda else None)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, tp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients before clipping; clips to max_norm when max_norm > 0.

    Tensor-parallel shards (param.tensor_model_parallel) are summed over tp; replicated
    weights hold the same gradient on every tp rank and count once. A non-finite norm may
    leave NaN gradients behind: the caller skips that step and zeroes them.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    sharded = [p.grad for p in params if getattr(p, "tensor_model_parallel", False)]
    replicated = [p.grad for p in params if not getattr(p, "tensor_model_parallel", False)]
    device = params[0].grad.device
    squares = [torch.zeros((), device=device, dtype=torch.float32) for _ in range(2)]
    for index, grads in enumerate((sharded, replicated)):
        if grads:
            squares[index] = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(squares[0], group=tp_group)
    norm = (squares[0] + squares[1]).sqrt()
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([p.grad for p in params], coefficient)
    return norm


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> Tuple[int, int]:
    """(elements, bytes) of the optimizer state tensors on this rank (for memory accounting)."""
    numel = nbytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                numel += value.numel()
                nbytes += value.numel() * value.element_size()
    return numel, nbytes
