"""Megatron-LM's data-parallel communication and distributed-optimizer flags, and the
`DataParallelConfig` they build (megatron/core/distributed/data_parallel.py acts on it).

Gradient reduction always overlaps the backward (torch DDP's buckets, FSDP2's per-layer
reduce-scatters): `--overlap-grad-reduce` is accepted and tuned by `--ddp-bucket-size` /
`--ddp-num-buckets`. Gradients are accumulated and reduced in fp32 unless `--grad-reduce-in-bf16`.
"""

from __future__ import annotations

import argparse
import os
import sys
import torch

from megatron.core.distributed.data_parallel import DataParallelConfig

FSDP2_STRATEGIES = ("optim_grads", "optim_grads_params")


def _sharded(args: argparse.Namespace) -> bool:
    return args.use_distributed_optimizer or args.data_parallel_sharding_strategy != "no_shard"


def _ddp(args: argparse.Namespace) -> bool:
    return args.data_parallel_sharding_strategy not in FSDP2_STRATEGIES


# (flag's dest, what it needs as typed, the test): appended to arguments.FLAG_NEEDS. The tests run
# before --use-distributed-optimizer is folded into the strategy, so they read both.
DATA_PARALLEL_FLAG_NEEDS = (
    ("num_distributed_optimizer_instances", "--use-distributed-optimizer (or a --data-parallel-sharding-strategy "
     "other than no_shard)", _sharded),
    ("grad_reduce_in_bf16", "--bf16 (fp32 training reduces fp32 gradients, as Megatron does)", lambda a: a.bf16),
    ("ddp_bucket_size", "--data-parallel-sharding-strategy no_shard or optim (FSDP2 reduces per layer)", _ddp),
    ("ddp_num_buckets", "--data-parallel-sharding-strategy no_shard or optim (FSDP2 reduces per layer)", _ddp),
    ("overlap_param_gather", "--use-distributed-optimizer (or a --data-parallel-sharding-strategy other than "
     "no_shard)", _sharded),
)


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-parallel communication and distributed optimizer")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="Copies of the distributed optimizer over the data-parallel replicas: the state (and "
                        "under FSDP2 the weights: HSDP) is sharded within groups of dp x cp / N consecutive "
                        "replicas and replicated across the N groups; gradients are still averaged over all.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: reduce gradients over the data-parallel replicas in bf16 (DDP: torch's "
                        "bf16 compression hook; FSDP2: a bf16 reduce_dtype). Default: in fp32.")
    g.add_argument("--ddp-bucket-size", type=int,
                   help="Gradient elements per DDP all-reduce bucket (Megatron counts elements; torch DDP's "
                        "bucket_cap_mb is derived from it). Default: torch DDP's 25 MiB.")
    g.add_argument("--ddp-num-buckets", type=int,
                   help="Instead of --ddp-bucket-size: split the replicated gradients into this many buckets.")


def validate_data_parallel_args(args: argparse.Namespace) -> None:
    """After validate_parallel (the strategy is resolved): one ValueError naming the flag."""
    for dest in ("ddp_bucket_size", "ddp_num_buckets"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(args, dest)} must be >= 1")
    if args.ddp_bucket_size is not None and args.ddp_num_buckets is not None:
        raise ValueError("give only one of --ddp-bucket-size and --ddp-num-buckets")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ValueError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; "
                         "choose one")
    strategy = args.data_parallel_sharding_strategy
    if args.overlap_param_gather and strategy == "optim" and int(os.environ.get("RANK", "0")) == 0:
        print("warning: --overlap-param-gather: ZeRO-1 (optim) broadcasts the updated weight shards at the end "
              "of the optimizer step, not overlapped with the next forward; FSDP2 strategies prefetch",
              file=sys.stderr, flush=True)
    args.data_parallel_config = DataParallelConfig(
        strategy=strategy, grad_reduce_dtype=torch.bfloat16 if args.grad_reduce_in_bf16 else None,
        param_dtype=torch.bfloat16 if args.bf16 and strategy in FSDP2_STRATEGIES else None,
        bucket_size=args.ddp_bucket_size, num_buckets=args.ddp_num_buckets,
        forward_prefetch=args.overlap_param_gather and strategy in FSDP2_STRATEGIES)


def describe(config: DataParallelConfig, replicas: int, instances: int, pipeline: bool = False) -> str:
    """The start-up line saying how the replicas synchronise."""
    reduce = "bf16" if config.grad_reduce_dtype == torch.bfloat16 else "fp32"
    if pipeline and config.strategy not in FSDP2_STRATEGIES:
        zero = f", ZeRO-1 over {replicas // instances} replicas" if config.strategy == "optim" else ""
        how = f"flat all-reduces after the pipeline schedule{zero}"
    elif config.strategy in FSDP2_STRATEGIES:
        sharding = f"HSDP ({instances} instances of {replicas // instances})" if instances > 1 else "FSDP2"
        gather = "bf16" if config.param_dtype == torch.bfloat16 else "fp32"
        prefetch = "explicit" if config.forward_prefetch else "implicit"
        how = f"{sharding} {config.strategy}, {gather} weights gathered, {prefetch} forward prefetch"
    else:
        if config.bucket_size is not None:
            buckets = f"buckets of {config.bucket_size} elements"
        elif config.num_buckets is not None:
            buckets = f"{config.num_buckets} buckets"
        else:
            buckets = "25 MiB buckets"
        zero = f", ZeRO-1 over {replicas // instances} replicas" if config.strategy == "optim" else ""
        how = f"DDP {buckets} overlapped with backward{zero}"
    return f"> data parallel: {replicas} replicas, {how}, gradients reduced in {reduce}"
