"""Tensor parallelism: split layers, vocab-parallel embedding and loss, region mappings, RNG streams.

Everything takes the tensor-parallel process group explicitly; `None` (or a group of one
rank) means no parallelism, and the layers then compute exactly what single-device
layers compute.
"""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_confident_entropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_master_weight,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    all_gather_dim,
    all_reduce_sum,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_dim,
)
from megatron.core.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    TensorParallelRNGTracker,
    checkpoint_with_tracker,
    model_parallel_rng_tracker,
    model_parallel_seed,
    stage_seed,
)
from megatron.core.tensor_parallel.utils import divide, group_rank, group_size, partition_range

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "init_master_weight",
    "set_tensor_model_parallel_attributes", "vocab_parallel_confident_entropy", "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_gather_dim", "reduce_scatter_dim", "all_reduce_sum",
    "split_dim", "MODEL_PARALLEL_RNG", "TensorParallelRNGTracker", "checkpoint_with_tracker",
    "model_parallel_rng_tracker",
    "model_parallel_seed", "stage_seed", "divide", "group_rank", "group_size", "partition_range",
]
