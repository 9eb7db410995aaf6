"""Tensor-parallel linear and embedding layers.

Every rank draws the same full ("master") weight from a seeded generator and keeps only
its slice, so a model gives the same numbers at any tensor-parallel size and a single
process (`tp_group=None`) is the reference every parallel run is tested against.

Parameters carry `tensor_model_parallel` (True when the tensor is split across tp ranks)
and `partition_dim` (the split dim, or None) so gradient-norm and clipping code can tell
sharded parameters from replicated ones without knowing the layer types.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.fp32_weight_grad import GemmLayer, LinearGemm
from megatron.core.tensor_parallel.tied_gradient import TiedGradient, embedding
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import check_index_range, divide, group_rank, group_size, partition_range

Group = Optional[dist.ProcessGroup]


def init_master_weight(shape: Sequence[int], std: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The full weight, drawn N(0, std) from a private generator seeded with `seed`.

    Private so the global RNG stream is untouched (dropout and data order do not shift
    when a layer is added), and drawn in fp32 before the cast so every dtype and every
    tensor-parallel size slices the very same numbers.
    """
    # Drawn on the default device (a `with torch.device("cuda")` block initialises on the GPU,
    # fast); CPU and CUDA generators give different numbers, each the same for every tp size.
    device = torch.get_default_device()
    if device.type == "meta":  # shape-only construction (e.g. counting parameters)
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    weight.normal_(mean=0.0, std=std, generator=generator)
    return weight.to(dtype)


def set_tensor_model_parallel_attributes(param: torch.Tensor, partition_dim: Optional[int]) -> None:
    """Tag `param` as split along `partition_dim`, or replicated over tp when it is None."""
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim


def _sharded(key: str, data: torch.Tensor, global_shape: Tuple[int, ...], split_dim: Optional[int],
             tp_rank: int, replica_id: int = 0) -> ShardedTensor:
    """A ShardedTensor whose piece sits at `tp_rank * local size` along `split_dim` (0s elsewhere)."""
    offset = [0] * data.dim()
    if split_dim is not None:
        offset[split_dim] = tp_rank * data.shape[split_dim]
    return ShardedTensor(key, data, tuple(global_shape), tuple(offset), replica_id)


class ColumnParallelLinear(GemmLayer):
    """`Y = X A^T + b` with A's output rows split across tensor-parallel ranks.

    The output dimension is read as `output_view` (default `(output_size,)`) and split
    along `split_dim` of that view, so fused weights keep their meaning per rank: a gated
    MLP's `[gate; up]` fc1 uses view `(2, ffn)` split 1 (each rank holds `[gate_r; up_r]`),
    a fused QKV laid out per query group uses `(groups, rows_per_group)` split 0.

    Input `[s, b, in]`, or `[s/tp, b, in]` with `sequence_parallel` (all-gathered on dim 0
    first). Output `[s, b, out/tp]`, or the full `[s, b, out]` in the original output order
    with `gather_output`.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 init_seed: int = 0, params_dtype: torch.dtype = torch.float32,
                 output_view: Optional[Tuple[int, ...]] = None, split_dim: int = 0,
                 fp32_weight_grad: bool = True) -> None:
        super().__init__()
        self.gemm = LinearGemm(fp32_weight_grad)  # the precision converter may swap it (fp32_weight_grad.py)
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.output_view = tuple(output_view) if output_view is not None else (output_size,)
        if math.prod(self.output_view) != output_size:
            raise ValueError(f"output_view {self.output_view} must multiply out to output_size {output_size}")
        if not -len(self.output_view) <= split_dim < len(self.output_view):
            raise ValueError(f"split_dim {split_dim} is not a dim of output_view {self.output_view}")
        self.split_dim = split_dim % len(self.output_view)
        local_view = list(self.output_view)
        local_view[self.split_dim] = divide(self.output_view[self.split_dim], self.tp_size,
                                            f"dim {self.split_dim} of the output view {self.output_view}")
        self.local_output_view = tuple(local_view)
        self.output_size_per_partition = output_size // self.tp_size

        master = init_master_weight((output_size, input_size), init_std, init_seed, params_dtype)
        self.weight = nn.Parameter(self._local_rows(master.view(*self.output_view, input_size)))
        set_tensor_model_parallel_attributes(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def _local_rows(self, viewed: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor shaped `(*output_view, ...)`, flattened back to rows."""
        size = self.local_output_view[self.split_dim]
        piece = viewed.narrow(self.split_dim, self.tp_rank * size, size)
        return piece.reshape(self.output_size_per_partition, *viewed.shape[len(self.output_view):]).clone()

    def _to_global_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """Reorder an output all-gathered on the last dim (rank-major) into `output_view` order.

        Rank-major concatenation equals the view order only when the split is on the
        view's first dim; otherwise the rank axis is moved next to `split_dim`.
        """
        if self.split_dim == 0 or self.tp_size == 1:
            return gathered
        lead = gathered.shape[:-1]
        ranked = gathered.reshape(*lead, self.tp_size, *self.local_output_view)
        ranked = ranked.movedim(len(lead), len(lead) + self.split_dim)
        return ranked.reshape(*lead, self.output_size)

    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input every rank multiplies: all-gathered over the sequence under sequence parallelism."""
        if self.sequence_parallel:
            # Every rank's column slice contributes to the input grad: reduce-scatter it back.
            return gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(x, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.gemm(self.parallel_input(x), self.weight, self.bias, self.grad_into())
        if self.gather_output:
            output = self._to_global_order(gather_from_tensor_model_parallel_region(output, self.tp_group))
        return output

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        """Weight as `(*output_view, in)` and bias as `output_view`: shapes that do not depend on tp."""
        weight = self.weight.detach().view(*self.local_output_view, self.input_size)
        result = {f"{prefix}weight": _sharded(f"{prefix}weight", weight, (*self.output_view, self.input_size),
                                              self.split_dim, self.tp_rank)}
        if self.bias is not None:
            bias = self.bias.detach().view(*self.local_output_view)
            result[f"{prefix}bias"] = _sharded(f"{prefix}bias", bias, self.output_view, self.split_dim, self.tp_rank)
        return result

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, view={self.output_view}, split_dim={self.split_dim}, "
                f"tp={self.tp_size}, bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(GemmLayer):
    """`Y = X A^T + b` with A's input columns split across tensor-parallel ranks.

    Each rank computes a partial sum from its input slice; the sum is all-reduced, or with
    `sequence_parallel` reduce-scattered on dim 0 into `[s/tp, b, out]`. The bias is
    replicated and added after the reduction so it is counted once. Under sequence
    parallelism each rank adds it to its own sequence slice only, so its gradient is partial:
    it is tagged `allreduce_over_tp` to be summed over tp (like the norms).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, init_std: float = 0.02,
                 init_seed: int = 0, params_dtype: torch.dtype = torch.float32, fp32_weight_grad: bool = True) -> None:
        super().__init__()
        self.gemm = LinearGemm(fp32_weight_grad)  # the precision converter may swap it (fp32_weight_grad.py)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel needs input_is_parallel=True: "
                             "the input must already be split on the hidden dim")
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.input_size_per_partition = divide(input_size, self.tp_size, "RowParallelLinear input_size")

        master = init_master_weight((output_size, input_size), init_std, init_seed, params_dtype)
        start, end = partition_range(input_size, self.tp_rank, self.tp_size)
        self.weight = nn.Parameter(master[:, start:end].clone())
        set_tensor_model_parallel_attributes(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, None)
            self.bias.allreduce_over_tp = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        return self.parallel_output(self.gemm(x, self.weight, None, self.grad_into()))

    def parallel_output(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum -> the output: reduced (or reduce-scattered), then the bias."""
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return output + self.bias if self.bias is not None else output

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        """Weight split along dim 1; the replicated bias is written by tp rank 0 only."""
        weight = self.weight.detach()
        result = {f"{prefix}weight": _sharded(f"{prefix}weight", weight, (self.output_size, self.input_size),
                                              1, self.tp_rank)}
        if self.bias is not None:
            result[f"{prefix}bias"] = _sharded(f"{prefix}bias", self.bias.detach(), (self.output_size,), None,
                                               self.tp_rank, replica_id=self.tp_rank)
        return result

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(GemmLayer):
    """Embedding table with its vocabulary rows split across tensor-parallel ranks.

    Rank r owns rows `[start, end)`. Ids outside them are looked up as row 0 and their
    vectors zeroed, so exactly one rank contributes each token and an all-reduce (or, with
    `sequence_parallel`, a reduce-scatter on dim 0 of sequence-first ids `[s, b]`) yields
    the full embedding. The vocabulary must be padded to a multiple of tp beforehand.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group = None, init_std: float = 0.02,
                 init_seed: int = 0, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.gemm = LinearGemm()  # what the tied output layer's loss reads the weight through
        self.vocab_start, self.vocab_end = partition_range(
            num_embeddings, self.tp_rank, self.tp_size, "num_embeddings (pad the vocabulary)")
        master = init_master_weight((num_embeddings, embedding_dim), init_std, init_seed, params_dtype)
        self.weight = nn.Parameter(master[self.vocab_start:self.vocab_end].clone())
        set_tensor_model_parallel_attributes(self.weight, 0)

    def forward(self, ids: torch.Tensor, tied: Optional[TiedGradient] = None) -> torch.Tensor:
        """`tied`: the loss's share of a tied weight's gradient, completed by this lookup's backward."""
        if self.tp_size == 1:
            output = embedding(ids, self.weight, tied, self.grad_into())
        else:
            output = self._partial_lookup(ids, tied)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)

    def _partial_lookup(self, ids: torch.Tensor, tied: Optional[TiedGradient] = None) -> torch.Tensor:
        """This rank's contribution: its rows for the ids it owns, zeros for the rest."""
        check_index_range(ids, self.num_embeddings, "token ids", IndexError)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
        # foreign rows get zero gradients (masked below)
        output = embedding(local_ids, self.weight, tied, self.grad_into())
        return output.masked_fill(foreign.unsqueeze(-1), 0.0)

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        """The table as `(num_embeddings, dim)` with this rank's rows at `vocab_start`."""
        key = f"{prefix}weight"
        return {key: _sharded(key, self.weight.detach(), (self.num_embeddings, self.embedding_dim), 0, self.tp_rank)}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}")
