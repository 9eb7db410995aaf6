"""Tensor-parallel communication as tiny autograd functions.

Each public function `f(x, group)` is a forward collective paired with its adjoint in
backward, so model code reads as single-device code with explicit region boundaries.
Tensors are sequence-first (`[s, b, h]`): tensor-parallel splits act on the last dim,
sequence-parallel splits on dim 0. With `group=None` or a group of one rank every function
returns its input unchanged.

Forward collectives never modify their input in place: the input may be saved for
another backward or shared with a residual branch, and autograd grads may be shared too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_rank, group_size, is_parallel, local_chunk

Group = Optional[dist.ProcessGroup]


# --- raw collectives (no autograd) -------------------------------------------------------

def _uses_fused_collectives(tensor: torch.Tensor, group: Group) -> bool:
    """NCCL has single-tensor all-gather / reduce-scatter; gloo historically lacks them.

    The backend string may name several (e.g. `cpu:gloo,cuda:nccl`), so the tensor's
    device decides which one actually runs.
    """
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group))


def _all_gather_fused(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """One-buffer all-gather (no per-rank list); gathers on dim 0, so move `dim` there first."""
    world = group_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    output = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, moved, group=group)
    return output.movedim(0, dim).contiguous()


def _all_gather_list(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Portable all-gather: one buffer per rank, then a concatenation."""
    pieces = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _reduce_scatter_fused(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """One-buffer reduce-scatter on dim 0 (moving `dim` there first); half the traffic of all-reduce."""
    world = group_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce-scatter over {world} ranks needs dim {dim} of {tuple(tensor.shape)} divisible")
    output = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, moved, group=group)
    return output.movedim(0, dim).contiguous()


def _reduce_scatter_list(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Portable reduce-scatter: all-reduce a copy, keep this rank's chunk (more traffic, same result)."""
    reduced = tensor.clone()
    dist.all_reduce(reduced, group=group)
    return local_chunk(reduced, dim, group_rank(group), group_size(group))


def all_gather_dim(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (rank order), on any backend."""
    if not is_parallel(group):
        return tensor
    if _uses_fused_collectives(tensor, group):
        return _all_gather_fused(tensor, dim, group)
    return _all_gather_list(tensor, dim, group)


def reduce_scatter_dim(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum `tensor` over ranks and keep this rank's chunk along `dim`, on any backend."""
    if not is_parallel(group):
        return tensor
    if _uses_fused_collectives(tensor, group):
        return _reduce_scatter_fused(tensor, dim, group)
    return _reduce_scatter_list(tensor, dim, group)


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over ranks into a fresh tensor, leaving `tensor` untouched (see the module note)."""
    if not is_parallel(group):
        return tensor
    reduced = tensor.clone()
    dist.all_reduce(reduced, group=group)
    return reduced


def split_dim(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk along `dim`: the adjoint of an all-gather when every rank holds the same value."""
    if not is_parallel(group):
        return tensor
    return local_chunk(tensor, dim, group_rank(group), group_size(group))


# --- autograd pairs ----------------------------------------------------------------------

class _CopyToTensorParallel(torch.autograd.Function):
    """Forward identity, backward all-reduce: each rank's input grad is a partial sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward all-reduce of partial sums, backward identity (the output grad is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBothWays(torch.autograd.Function):
    """Forward all-reduce, backward all-reduce: every rank feeds the sum to compute of its own
    (other heads), so each rank's output grad is a partial sum of the true one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _SplitForwardGatherBackward(torch.autograd.Function):
    """Forward keeps this rank's chunk along `dim`; backward all-gathers the chunk grads."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    """Forward all-gathers along `dim`; backward keeps this rank's chunk of the (replicated) grad."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, ctx.dim, ctx.group), None, None


class _GatherForwardReduceScatterBackward(torch.autograd.Function):
    """Forward all-gathers along `dim`; backward reduce-scatters grads that are partial sums."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterForwardGatherBackward(torch.autograd.Function):
    """Forward reduce-scatters partial sums along `dim`; backward all-gathers the chunk grads."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


# --- public region boundaries ------------------------------------------------------------

def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input (identity; input grads all-reduced in backward)."""
    return _CopyToTensorParallel.apply(x, group) if is_parallel(group) else x


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region by summing partial outputs (all-reduce; identity in backward)."""
    return _ReduceFromTensorParallel.apply(x, group) if is_parallel(group) else x


def all_reduce_with_partial_grads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a statistic over the TP ranks that each rank then uses in its own, different compute
    (the full-width QK-norm's sum of squares over heads split across ranks): all-reduce forward,
    all-reduce of the partial grads backward."""
    return _AllReduceBothWays.apply(x, group) if is_parallel(group) else x


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim (all-gather of the grads in backward)."""
    return _SplitForwardGatherBackward.apply(x, group, -1) if is_parallel(group) else x


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim (each rank keeps its slice of the grad in backward)."""
    return _GatherForwardSplitBackward.apply(x, group, -1) if is_parallel(group) else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0); all-gather the grads in backward."""
    return _SplitForwardGatherBackward.apply(x, group, 0) if is_parallel(group) else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0) to enter a TP region.

    In backward the grad is reduce-scattered when the gathered tensor fed tensor-parallel
    compute (each rank then holds a partial sum), or just split when every rank computed
    the same full grad (`tensor_parallel_output_grad=False`).
    """
    if not is_parallel(group):
        return x
    if tensor_parallel_output_grad:
        return _GatherForwardReduceScatterBackward.apply(x, group, 0)
    return _GatherForwardSplitBackward.apply(x, group, 0)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region into a sequence-parallel one: sum partial outputs, keep this rank's
    sequence slice (all-gather in backward). Same traffic as the all-reduce it replaces."""
    return _ReduceScatterForwardGatherBackward.apply(x, group, 0) if is_parallel(group) else x


def all_gather_reduce_scatter_grad(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along `dim` (in rank order); the backward reduce-scatters the gradient, which
    every rank computed a partial sum of (context parallelism's keys and values)."""
    return _GatherForwardReduceScatterBackward.apply(x, group, dim) if is_parallel(group) else x
