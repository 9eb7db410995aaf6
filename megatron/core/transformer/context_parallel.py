"""Context parallelism: one sequence split over the cp ranks, attention exact over all of it.

Which positions a rank holds (`shard_positions`):
- bidirectional attention (`no_mask`, with or without packed documents): one contiguous chunk
  of S / C positions. Every query sees every key, so the chunks cost the same.
- every masked type (causal, block-causal, sliding window): the sequence is cut into 2C chunks
  and rank i holds chunks i and 2C - 1 - i, so each rank has as many early (cheap) as late
  (expensive) queries under a causal mask.
The batch is sliced after the corruption (objective.py), so per-row quantities (weights, the
normalizer) are computed on whole rows and are the same on every cp rank.

Attention (`all_gather`, Megatron's `--cp-comm-type all_gather`): each rank keeps its queries
and all-gathers the keys and values of the cp group, in rank order (`gathered_positions`
says which global position each gathered key has); the backward reduce-scatters dK / dV.
The local kernel then runs once over the whole K / V (cuDNN SDPA for the full bidirectional
mask), with the mask evaluated at the true query and key positions (AttentionMask positions).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import all_gather_reduce_scatter_grad
from megatron.core.tensor_parallel.utils import group_rank, group_size

COMM_TYPES = ("all_gather",)


def load_balanced(mask_type: str) -> bool:
    """Whether a mask type's work per query grows along the sequence (then 2C chunks)."""
    return mask_type != "no_mask"


def shard_divisor(cp_size: int, mask_type: str) -> int:
    """What the sequence length must be divisible by under `cp_size` ranks."""
    return 2 * cp_size if load_balanced(mask_type) else cp_size


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, balanced: bool,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions rank `cp_rank` holds, in the order it holds them ([seq_len / cp_size])."""
    if seq_len % (2 * cp_size if balanced else cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by {'2 x ' if balanced else ''}"
                         f"--context-parallel-size {cp_size}")
    if not balanced:
        chunk = seq_len // cp_size
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    chunk = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange(late * chunk, (late + 1) * chunk, device=device)])


def gathered_positions(seq_len: int, cp_size: int, balanced: bool,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """The global position of each key after the all-gather (ranks' shards in rank order)."""
    return torch.cat([shard_positions(seq_len, cp_size, rank, balanced, device) for rank in range(cp_size)])


class ContextShard:
    """This rank's share of the sequences of a cp group: which positions, and the slicing."""

    def __init__(self, group: Optional[dist.ProcessGroup], mask_type: str) -> None:
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.balanced = load_balanced(mask_type)

    @property
    def active(self) -> bool:
        return self.size > 1

    def positions(self, seq_len: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(this rank's query positions, the gathered keys' positions) of a global `seq_len`."""
        return (shard_positions(seq_len, self.size, self.rank, self.balanced, device),
                gathered_positions(seq_len, self.size, self.balanced, device))

    def slice(self, tensor: Optional[torch.Tensor], dim: int = 1) -> Optional[torch.Tensor]:
        """This rank's positions of `tensor` along `dim` (the sequence dim of a [b, s] batch)."""
        if tensor is None or not self.active:
            return tensor
        positions = shard_positions(tensor.shape[dim], self.size, self.rank, self.balanced, tensor.device)
        return tensor.index_select(dim, positions)


def gather_keys_and_values(key: torch.Tensor, value: torch.Tensor,
                           group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """[b, h, s/C, d] keys and values of every cp rank, [b, h, s, d] in rank order; their
    gradients are reduce-scattered back (each rank's queries contribute to every key)."""
    if group_size(group) == 1:
        return key, value
    return all_gather_reduce_scatter_grad(key, group, 2), all_gather_reduce_scatter_grad(value, group, 2)
