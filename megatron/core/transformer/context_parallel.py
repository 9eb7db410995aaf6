"""Context parallelism: one sequence split over the cp ranks, attention exact over all of it.

Which positions a rank holds (`shard_positions`):
- bidirectional attention (`no_mask`, with or without packed documents): one contiguous chunk
  of S / C positions. Every query sees every key, so the chunks cost the same.
- every masked type (causal, block-causal, sliding window): the sequence is cut into 2C chunks
  and rank i holds chunks i and 2C - 1 - i, so each rank has as many early (cheap) as late
  (expensive) queries under a causal mask.
The batch is sliced after the corruption (objective.py), so per-row quantities (weights, the
normalizer) are computed on whole rows and are the same on every cp rank.

Attention, two ways (Megatron's `--cp-comm-type`):
- `all_gather`: each rank keeps its queries and all-gathers the keys and values of the cp
  group, in rank order (`gathered_positions` says which global position each gathered key
  has); the backward reduce-scatters dK / dV. The local kernel runs once over the whole K / V
  (cuDNN SDPA for the full bidirectional mask), with the mask evaluated at the true query and
  key positions (AttentionMask positions). Traffic per layer: 2 x S x kv heads x d.
- `a2a` (Ulysses): an all-to-all turns sequence shards of every head into whole sequences of
  1/C of the heads (`sequence_to_heads`), the kernel attends over the whole sequence, and a
  second all-to-all turns the output back (`heads_to_sequence`); each all-to-all's backward is
  the other. Traffic per layer: (2 q-sized + 2 kv-sized) x S / C; no whole K / V is kept per
  rank. It pays where all-gathering K / V does not: many kv heads (MHA models such as LLaDA-8B's
  32) and long sequences; it needs the heads per tensor-parallel rank divisible by C (kv heads
  too, or C divisible by them: they are then replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import all_gather_reduce_scatter_grad
from megatron.core.tensor_parallel.utils import group_rank, group_size

COMM_TYPES = ("all_gather", "a2a")


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


def _all_to_all(blocks: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """[C, ...] contiguous: block j goes to rank j; returns [C, ...] whose block j came from rank j."""
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    return received


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    batch, heads, seq, dim = x.shape
    blocks = x.reshape(batch, size, heads // size, seq, dim).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(blocks, group)  # [C (rank: sequence part), b, heads / C, s / C, d]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * seq, dim)


def _to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    batch, heads, seq, dim = x.shape
    blocks = x.reshape(batch, heads, size, seq // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(blocks, group)  # [C (rank: head group), b, heads, s / C, d]
    return received.permute(1, 0, 2, 3, 4).reshape(batch, size * heads, seq // size, dim)


class _AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all: [b, h, s/C, d] -> [b, h/C, s, d] (`to_heads`) or back; the backward is the
    other direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_to_sequence if ctx.to_heads else _to_heads)(grad, ctx.group), None, None


def sequence_to_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses' first all-to-all: this rank's 1/C of the heads over the whole sequence. kv heads
    fewer than C are replicated first, so each rank gets the kv head its query heads use."""
    size = group_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(f"--cp-comm-type a2a needs the {heads} query heads per tensor-parallel rank divisible by "
                         f"--context-parallel-size {size}, and the {kv_heads} kv heads divisible by it or dividing it")
    if kv_heads % size:
        key = key.repeat_interleave(size // kv_heads, dim=1)
        value = value.repeat_interleave(size // kv_heads, dim=1)
    return tuple(_AllToAll.apply(t, group, True) for t in (query, key, value))


def heads_to_sequence(context: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Ulysses' second all-to-all: the attention output back to this rank's sequence shard, all heads."""
    return _AllToAll.apply(context, group, False)


def whole_sequence_mask(mask):
    """The mask of a rank's queries against the gathered keys, for queries over the whole sequence
    in the same (gathered) order, as Ulysses attends."""
    return dataclasses.replace(mask, query_positions=mask.key_positions)
