"""Small helpers shared by the tensor-parallel layers: group sizes, exact division, splitting.

Every function takes the tensor-parallel group explicitly. `None` means "no tensor
parallelism" (size 1, rank 0) rather than "the default process group", so a layer built
with `tp_group=None` behaves exactly like a single-device layer even inside a distributed
job.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in `group`; 1 for `None` (which here means no parallelism, not WORLD)."""
    return 1 if group is None else dist.get_world_size(group)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: a DTensor's local shard (FSDP2), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank *inside* `group` (not its global rank); 0 for `None`."""
    return 0 if group is None else dist.get_rank(group)


def is_parallel(group: Optional[dist.ProcessGroup]) -> bool:
    """True when collectives over `group` do real work; lets callers skip them otherwise."""
    return group_size(group) > 1


def all_reduce_in_place(tensor: torch.Tensor, op: dist.ReduceOp, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (nothing without parallelism) and return it. In
    place, without autograd: for tensors the caller allocated itself (the vocab-parallel losses'
    maxima and sums), which nothing else holds."""
    if is_parallel(group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division that names the quantity when it does not divide.

    Shard sizes must be exact: a silent floor would drop rows and give wrong results on
    some ranks only, which is much harder to find than this error.
    """
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size "
                         f"({denominator}); pick sizes that divide evenly (pad the vocabulary, change "
                         f"the head or hidden sizes) or use a smaller tensor-model-parallel size")
    return numerator // denominator


def partition_range(total: int, rank: int, world_size: int, what: str = "size") -> Tuple[int, int]:
    """The `[start, end)` slice of `total` items that `rank` owns when split evenly."""
    per_rank = divide(total, world_size, what)
    return rank * per_rank, (rank + 1) * per_rank


def local_chunk(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous piece of `tensor` along `dim`.

    Contiguous because the piece is usually handed to a collective or kept as a parameter;
    a strided view would keep the whole source tensor alive.
    """
    size = divide(tensor.shape[dim], world_size, f"dimension {dim} of shape {tuple(tensor.shape)}")
    return tensor.narrow(dim, rank * size, size).contiguous()


def check_index_range(indices: torch.Tensor, size: int, what: str, error: type = ValueError) -> None:
    """Raise `error` unless every index lies in `[0, size)`.

    Vocab-parallel code masks indices outside a rank's range; one outside *every* range
    would silently become zeros instead of failing as single-device code does. One
    host sync (min and max fetched together) is the price of catching it.
    """
    if indices.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(indices)).tolist()
    if low < 0 or high >= size:
        raise error(f"{what} must lie in [0, {size}), got values in [{low}, {high}]")
