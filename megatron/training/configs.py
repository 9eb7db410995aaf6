"""Typed configs of the training loop, built once from the flags (arguments.py).

The loop's pieces receive these instead of the argparse Namespace: `Trainer` a
`TrainingConfig`, `Checkpointer` and `load_checkpoint` a `CheckpointConfig` and the
`RunRecord` (what a checkpoint records about the run and what `--load` compares),
`TrainingLogger` a `LoggingConfig`. Field names are the flags' destinations
(`--save-interval` -> `save_interval`), so `from_args` needs no table; `validate()` names the
flag and the fix. The model's own configs are `TransformerConfig` and `DLMConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


class _FromArgs:
    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The fields of `cls` read from the flags of the same names, then validated."""
        config = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
        config.validate()
        return config

    def validate(self) -> None:
        pass


@dataclass
class TrainingConfig(_FromArgs):
    """Batches, iterations and the rules that end or skip a step."""

    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel replica (--micro-batch-size)."""
    global_batch_size: int = 1
    """Samples per optimizer step, over every replica and micro-batch (--global-batch-size)."""
    num_microbatches: int = 1
    """Micro-batches each replica accumulates per step (global / (micro x replicas))."""
    train_iters: int = 1
    """Optimizer steps of the whole run (--train-iters, or --train-samples / global batch)."""
    seq_length: int = 1
    """Tokens per sample (--seq-length)."""
    seed: int = 1234
    """Seed of the weights, dropout and data order (--seed)."""
    fp16: bool = False
    """fp16 compute with dynamic loss scaling (--fp16)."""
    initial_loss_scale: float = 2.0 ** 16
    """fp16's first loss scale (--initial-loss-scale)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables (--clip-grad)."""
    max_consecutive_nan_iterations: int = 10
    """Stop after this many steps in a row with a non-finite loss or grad norm."""
    eval_iters: int = 0
    """Validation global batches per evaluation; 0 disables evaluation (--eval-iters)."""
    eval_interval: int = 1000
    """Evaluate every N iterations, and at the end (--eval-interval)."""
    exit_interval: Optional[int] = None
    """Stop after the iteration divisible by this (--exit-interval)."""
    exit_duration_in_mins: Optional[float] = None
    """Stop after this many minutes of training (--exit-duration-in-mins)."""
    exit_signal_handler: bool = False
    """SIGTERM ends the run cleanly after the step, with a save (--exit-signal-handler)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (--num-workers)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages: chooses the micro-batch schedule (--pipeline-model-parallel-size)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; None without interleaving (>= 2 otherwise;
    from --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage)."""
    pipeline_layer_counts: Optional[list] = None
    """Transformer layers of every virtual stage s = chunk x pipeline size + rank, laid out contiguously in
    that order (pipeline_parallel/layer_split.py); [num_layers] with one stage."""

    def validate(self) -> None:
        # The sizes and the batch split are checked by flag before they are derived
        # (arguments._validate_ranges, _validate_batch_and_schedule); what is left is this.
        if self.eval_interval < 1:
            raise ValueError(f"--eval-interval {self.eval_interval} must be >= 1")


@dataclass
class CheckpointConfig(_FromArgs):
    """Where and when checkpoints are written and what a load restores."""

    save: Optional[str] = None
    """Directory of the checkpoints this run writes (--save)."""
    load: Optional[str] = None
    """Directory whose latest checkpoint this run starts from, if any (--load)."""
    save_interval: Optional[int] = None
    """Save every N iterations; the end of training is always saved (--save-interval)."""
    async_save: bool = False
    """Write in the background after a host copy (--async-save)."""
    no_save_optim: bool = False
    """Save the weights only (--no-save-optim)."""
    no_load_optim: bool = False
    """Load the weights only, with a fresh optimizer (--no-load-optim)."""
    no_load_rng: bool = False
    """Keep this run's RNG states instead of the checkpoint's (--no-load-rng)."""
    finetune: bool = False
    """Load the weights only and start at iteration 0; accepts a checkpoint computing another
    function (rotary base, mask token, running mode, ...) on purpose (--finetune)."""
    keep_last_checkpoints: Optional[int] = None
    """Delete all but the newest N iterations up to the one just saved (--keep-last-checkpoints)."""

    def validate(self) -> None:
        if self.save_interval is not None and (self.save_interval < 1 or not self.save):
            raise ValueError("--save-interval needs --save DIR and a positive interval")
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save DIR")


@dataclass
class LoggingConfig(_FromArgs):
    """What the console, tensorboard and wandb receive."""

    log_interval: int = 100
    """Print (and record) one line every N iterations (--log-interval)."""
    log_throughput: bool = False
    """Add tokens/s, TFLOP/s and MFU to the console line (--log-throughput)."""
    tensorboard_dir: Optional[str] = None
    """Write tensorboard scalars here (--tensorboard-dir)."""
    wandb_project: Optional[str] = None
    """Log to this wandb project; needs the wandb package (--wandb-project)."""
    wandb_exp_name: Optional[str] = None
    """The wandb run's name (--wandb-exp-name)."""

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ValueError("--log-interval must be >= 1")


@dataclass
class RunRecord:
    """What a checkpoint records about the run that wrote it, and what `--load` compares."""

    transformer_config: TransformerConfig
    dlm_config: DLMConfig
    seq_length: int
    tokenizer: Optional[dict] = None
    """The tokenizer's identity (type, vocabulary size, special ids, sha256 of its files)."""
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    data_parallel_sharding_strategy: str = "no_shard"
    sequence_parallel: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunRecord":
        return cls(transformer_config=args.transformer_config, dlm_config=args.dlm_config,
                   seq_length=args.seq_length, tokenizer=getattr(args.tokenizer, "identity", None),
                   world_size=args.world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
                   data_parallel_size=args.data_parallel_size,
                   pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                   virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                   data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
                   sequence_parallel=args.sequence_parallel)
