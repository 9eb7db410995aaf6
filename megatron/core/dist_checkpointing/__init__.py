"""Sharded checkpoints on torch.distributed.checkpoint (see mapping.py for the shard description)."""

from megatron.core.dist_checkpointing.mapping import ShardedTensor

__all__ = ["ShardedTensor"]
