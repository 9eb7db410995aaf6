"""Plain data parallelism on torch DDP, with Megatron's per-token loss normalisation.

Micro-batches backpropagate the *sum* of their weighted token losses; after the last one,
`finalize_gradients` divides by the number of loss tokens of the whole global batch (all
micro-batches, all data-parallel ranks). Gradient accumulation and data parallelism then
equal one big batch exactly, whatever the split.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_data_parallel(model: nn.Module, device: torch.device, group=None) -> nn.Module:
    """DDP over `group` when it has more than one rank; the bare model otherwise."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return model
    device_ids = [device] if device.type == "cuda" else None
    # Buffers are derived tables (RoPE), identical everywhere: no broadcast per step.
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                   broadcast_buffers=False, gradient_as_bucket_view=True)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def no_sync(model: nn.Module, last_microbatch: bool) -> ContextManager:
    """Skip the gradient all-reduce on every micro-batch but the last."""
    if isinstance(model, DistributedDataParallel) and not last_microbatch:
        return model.no_sync()
    return nullcontext()


def data_parallel_size(model: nn.Module) -> int:
    if isinstance(model, DistributedDataParallel):
        return dist.get_world_size(model.process_group)
    return 1


def allreduce_tensor_parallel_partial_grads(model: nn.Module, tp_group) -> None:
    """Sum over tp the gradients of replicated weights that each rank saw only part of:
    norms under sequence parallelism, QK-norms shared by heads split over ranks."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce_over_tp", False)]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(chunk.view_as(grad))


def finalize_gradients(model: nn.Module, total_loss_tokens: torch.Tensor, tp_group=None) -> None:
    """Turn the (DDP-averaged) summed gradients into gradients of sum / total_loss_tokens."""
    allreduce_tensor_parallel_partial_grads(model, tp_group)
    scale = data_parallel_size(model) / total_loss_tokens.clamp(min=1.0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device, grads[0].dtype))
