"""RunConfig: every typed config of one run, built once from the parsed flags.

`pretrain()` parses the flags (arguments.py; the argparse Namespace stays there), builds one
`RunConfig` with `run_config(args)` and hands it, never the Namespace, to `build_trainer` and
to the entry point's callbacks: `model_provider(config, ...)`,
`train_valid_test_datasets_provider(config, num_samples)` and
`forward_step(data_iterator, model, ctx, config)`. The bundle and the groups defined here are
frozen; each field names the flag it comes from.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

from megatron.core.distributed.data_parallel import DataParallelConfig
from megatron.core.optimizer.optimizer import OptimizerConfig
from megatron.core.precision.apply import PrecisionConfig
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.arguments import ExtraArgsProvider, parse_args, schedule_kwargs
from megatron.training.configs import (CheckpointConfig, FromArgs, LMEvalConfig, LoggingConfig, ProfilingConfig,
                                       RunRecord, TrainingConfig)
from megatron.training.precision_args import moment_dtypes, precision_config
from megatron.training.rerun import RerunConfig
from megatron.training.tokenizer.base import MegatronTokenizer


@dataclass(frozen=True)
class ParallelConfig(FromArgs):
    """The process layout: parallel sizes, stage split, data-parallel wrapper and process group (the
    run's one home of the sizes; the model's layers read their groups'). --sequence-parallel is the
    model's `TransformerConfig.sequence_parallel`, as in Megatron."""

    world_size: int = 1
    """Processes of the run (torchrun's WORLD_SIZE)."""
    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size."""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size."""
    context_parallel_size: int = 1
    """--context-parallel-size."""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size."""
    expert_tensor_parallel_size: Optional[int] = None
    """--expert-tensor-parallel-size (resolved by parallel_args.py)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank; None without interleaving (--num-virtual-stages-per-pipeline-rank
    or --num-layers-per-virtual-pipeline-stage)."""
    num_distributed_optimizer_instances: int = 1
    """--num-distributed-optimizer-instances."""
    pipeline_layer_counts: Optional[list] = None
    """Transformer layers of every virtual stage (--decoder-first/last-pipeline-num-layers, parallel_args.py)."""
    data_parallel_config: DataParallelConfig = field(default_factory=DataParallelConfig)
    """The data-parallel wrapper: --data-parallel-sharding-strategy (and the flags that choose it),
    --grad-reduce-in-bf16, --ddp-bucket-size, --ddp-num-buckets, --overlap-param-gather."""
    distributed_backend: Optional[str] = None
    """--distributed-backend; None: nccl on GPU, gloo on CPU."""
    distributed_timeout_minutes: int = 10
    """--distributed-timeout-minutes."""

    @property
    def sharding_strategy(self) -> str:
        """--data-parallel-sharding-strategy."""
        return self.data_parallel_config.strategy


@dataclass(frozen=True)
class DataConfig(FromArgs):
    """What the datasets provider and get_batch read: sources, tokenizer and the batch rules."""

    tokenizer: Optional[MegatronTokenizer] = None
    """The tokenizer of --tokenizer-type and its files."""
    padded_vocab_size: int = 0
    """The vocabulary padded to --make-vocab-size-divisible-by (times the tensor-parallel size); ids at or
    above it are refused."""
    seq_length: int = 1
    """Tokens per sample (--seq-length)."""
    seed: int = 1234
    """Seed of the mock data, the shuffles and the SFT packing (--seed)."""
    mock_data: bool = False
    """Synthetic samples instead of files (--mock-data)."""
    data_path: Optional[list] = None
    """Weighted prefixes split into train/valid/test by --split (--data-path)."""
    split: str = "969,30,1"
    """Train,valid,test proportions of --data-path (--split)."""
    train_data_path: Optional[list] = None
    """--train-data-path."""
    valid_data_path: Optional[list] = None
    """--valid-data-path."""
    test_data_path: Optional[list] = None
    """--test-data-path."""
    data_cache_path: Optional[str] = None
    """Where the index files are written (--data-cache-path)."""
    no_mmap_bin_files: bool = False
    """Read the .bin files instead of memory-mapping them (--no-mmap-bin-files)."""
    eod_mask_loss: bool = False
    """No loss on EOD labels (--eod-mask-loss)."""
    reset_attention_mask: bool = False
    """Attention stays inside each document of a packed row (--reset-attention-mask)."""
    reset_position_ids: bool = False
    """Positions restart at each document (--reset-position-ids)."""
    sft: bool = False
    """Rows of chat examples, loss on the answers only (--sft)."""
    sft_padding: str = "eos"
    """How --sft fills a row (--sft-padding): eos, one example right-padded with EOD; pack, examples
    packed with attention inside each."""


@dataclass(frozen=True)
class RunConfig:
    """One run's configs: the model, its layout, data, optimizer, loop, checkpoints and logging."""

    model: TransformerConfig
    """The transformer's architecture and precision (arguments.transformer_config_from_args)."""
    dlm: DLMConfig
    """The running mode and the corruption (custom_args/difflm.py's --difflm-* flags)."""
    parallel: ParallelConfig
    """The layout: --tensor/pipeline/context/expert-model-parallel-size, the data-parallel strategy and the
    process group's flags."""
    data: DataConfig
    """What the datasets provider and get_batch read: --seq-length, --tokenizer-type, --mock-data, the paths,
    --split, --eod-mask-loss, --reset-*, --sft."""
    training: TrainingConfig
    """Batches, iterations and the exit rules (--micro-batch-size, --train-iters, ...)."""
    optimizer: OptimizerConfig
    """AdamW: --lr, --weight-decay, --adam-*, --clip-grad, --decoupled-lr, --compile-optimizer-step, --exp-avg-*."""
    lr_schedule: Mapping[str, object]
    """OptimizerParamScheduler's keyword arguments (--lr-*, --min-lr, --*-weight-decay; schedule_args.py)."""
    precision: PrecisionConfig
    """--cache-low-precision-weights, --fp8-* and fp16's loss scaling (--fp16, --*loss-scale*, --hysteresis)."""
    checkpoint: CheckpointConfig
    """--save, --load and their options."""
    logging: LoggingConfig
    """--log-*, --tensorboard-*, --wandb-*, --timing-log-*."""
    profiling: ProfilingConfig
    """--profile and its window, --record-memory-history."""
    rerun: RerunConfig
    """--rerun-mode, --check-for-*, --error-injection-* (rerun_args.py)."""
    lm_eval: LMEvalConfig
    """--lm-eval-* (in-loop lm-eval tasks)."""
    record: RunRecord
    """What a checkpoint records about the run and what --load compares."""
    torch_compile: bool = False
    """Compile every transformer layer (--torch-compile)."""
    deterministic_mode: bool = False
    """Deterministic kernels only (--deterministic-mode)."""


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                           adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                           decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                           compiled_step=args.compile_optimizer_step, **moment_dtypes(args))


def run_config(args: argparse.Namespace) -> RunConfig:
    """The bundle of the flags parse_args validated (the one place a RunConfig is built from them)."""
    return RunConfig(
        model=args.transformer_config, dlm=args.dlm_config, parallel=ParallelConfig.from_args(args),
        data=DataConfig.from_args(args), training=args.training_config, optimizer=optimizer_config(args),
        lr_schedule=types.MappingProxyType(schedule_kwargs(args)), precision=precision_config(args),
        checkpoint=args.checkpoint_config, logging=args.logging_config, profiling=ProfilingConfig.from_args(args),
        rerun=args.rerun_config, lm_eval=args.lm_eval_config, record=args.run_record,
        torch_compile=args.torch_compile, deterministic_mode=args.deterministic_mode)


def parse_run_config(argv: Optional[List[str]] = None, extra_args_provider: Optional[ExtraArgsProvider] = None,
                     world_size: Optional[int] = None) -> RunConfig:
    """parse_args, then run_config: the bundle of `argv` (tests, benchmarks and tools build runs this way)."""
    return run_config(parse_args(argv, extra_args_provider, world_size))
