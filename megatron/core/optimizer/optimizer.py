"""AdamW with Megatron's parameter groups, and the gradient clipping of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch
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


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total L2 norm of the gradients before clipping; clips to max_norm when max_norm > 0.

    A non-finite norm may leave NaN gradients behind: the caller skips that step and zeroes them.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    return torch.nn.utils.clip_grad_norm_(list(parameters), limit, error_if_nonfinite=False)


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> Tuple[int, int]:
    """(elements, bytes) of the optimizer state tensors on this rank (for memory accounting)."""
    numel = nbytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                numel += value.numel()
                nbytes += value.numel() * value.element_size()
    return numel, nbytes
