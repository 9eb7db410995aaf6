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
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.batch_schedule import BatchSchedule


class FromArgs:
    """Base of the configs built from the parsed flags (rerun.py's RerunConfig too)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The fields of `cls` read from the flags of the same names, then validated."""
        config = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
        config.validate()
        return config

    def validate(self) -> None:
        pass


@dataclass
class TrainingConfig(FromArgs):
    """Batches, iterations and the rules that end or skip a step."""

    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel replica (--micro-batch-size)."""
    global_batch_size: int = 1
    """Samples per optimizer step, over every replica and micro-batch (--global-batch-size)."""
    num_microbatches: int = 1
    """Micro-batches each replica accumulates per step (global / (micro x replicas))."""
    data_parallel_size: int = 1
    """Data-parallel replicas; with a batch ramp a step's micro-batches are its batch / (micro x replicas)."""
    rampup_batch_size: Optional[list] = None
    """(start, increment, samples) of --rampup-batch-size: the global batch grows with the samples consumed."""
    step_batch_size_schedule: Optional[str] = None
    """--step-batch-size-schedule: the global batch by tokens consumed (batch_schedule.py)."""
    train_iters: int = 1
    """Optimizer steps of the whole run (--train-iters, or --train-samples / global batch)."""
    seq_length: int = 1
    """Tokens per sample (--seq-length)."""
    seed: int = 1234
    """Seed of the weights, dropout and data order (--seed)."""
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
    exit_signal: str = "SIGTERM"
    """The signal --exit-signal-handler waits for (--exit-signal)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (--num-workers)."""
    manual_gc: bool = False
    """Python's automatic GC off; collections at the same steps on every rank (--manual-gc)."""
    manual_gc_interval: int = 0
    """With manual_gc: collect after every N-th step, 0 never between steps (--manual-gc-interval)."""
    manual_gc_eval: bool = True
    """With manual_gc: collect before and after each evaluation (--manual-gc-eval)."""
    empty_unused_memory_level: int = 0
    """torch.cuda.empty_cache(): 1 after forward-backward and evaluation, 2 also after the optimizer."""
    skip_train: bool = False
    """Evaluate only, no training step (--skip-train)."""
    difflm_eval_mc_samples: int = 1
    """Corruption draws per validation row; the logged loss pools them (--difflm-eval-mc-samples)."""

    @functools.cached_property
    def batch_schedule(self) -> BatchSchedule:
        """The global batch size at each consumed-samples count (constant without a ramp)."""
        return BatchSchedule.from_flags(self.global_batch_size, self.rampup_batch_size,
                                        self.step_batch_size_schedule, self.seq_length)

    def batch_at(self, consumed_samples: int) -> Tuple[int, int]:
        """(global batch size, micro-batches per replica) of the step after `consumed_samples`."""
        if not self.batch_schedule.varies:
            return self.global_batch_size, self.num_microbatches
        size = self.batch_schedule.at(consumed_samples)
        return size, size // (self.micro_batch_size * self.data_parallel_size)

    def validate(self) -> None:
        # The sizes and the batch split are checked by flag before they are derived
        # (arguments._validate_ranges, _validate_batch_and_schedule); what is left is this.
        if self.eval_interval < 1:
            raise ValueError(f"--eval-interval {self.eval_interval} must be >= 1")


@dataclass
class CheckpointConfig(FromArgs):
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
    override_opt_param_scheduler: bool = False
    """Keep this run's LR/WD schedule flags instead of the checkpoint's; only the position on the
    schedule is restored (--override-opt-param-scheduler)."""
    keep_last_checkpoints: Optional[int] = None
    """Delete all but the newest N iterations up to the one just saved (--keep-last-checkpoints)."""
    checkpoint_steps: tuple = ()
    """Further iterations to save at, besides every --save-interval (--checkpoint-steps)."""
    no_save_rng: bool = False
    """Leave the RNG states out of the checkpoints this run writes (--no-save-rng)."""
    ckpt_fully_parallel_save: bool = True
    """Spread the writes of replicated tensors over the ranks holding them (--no-ckpt-fully-parallel-save)."""
    ckpt_assume_constant_structure: bool = False
    """Reuse DCP's save plan from the second save on (--ckpt-assume-constant-structure)."""
    ckpt_step: Optional[int] = None
    """Load this iteration instead of the newest (--ckpt-step)."""
    exit_on_missing_checkpoint: bool = False
    """With --load and no checkpoint there: stop instead of starting from scratch."""
    non_persistent_save_interval: Optional[int] = None
    """Save a non-persistent checkpoint every N iterations (checkpoint_sources.py)."""
    non_persistent_ckpt_type: Optional[str] = None
    """global (a sharded checkpoint of its own directory) or local (per-rank files on node-local storage)."""
    non_persistent_global_ckpt_dir: Optional[str] = None
    """Where global non-persistent checkpoints go (default <save or load>/non_persistent)."""
    non_persistent_local_ckpt_dir: Optional[str] = None
    """Node-local directory of the local non-persistent checkpoints."""

    def validate(self) -> None:
        if self.save_interval is not None and (self.save_interval < 1 or not self.save):
            raise ValueError("--save-interval needs --save DIR and a positive interval")
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save DIR")


@dataclass
class LoggingConfig(FromArgs):
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
    log_progress: bool = False
    """Append throughput and progress lines to <save>/progress.txt (--log-progress)."""
    timing_log_level: int = 0
    """0: iteration time only; 1: per-step phases; 2: also every data fetch (--timing-log-level)."""
    timing_log_option: str = "minmax"
    """Timers on the console: max, minmax or all ranks (--timing-log-option)."""
    tensorboard_log_interval: int = 1
    """Record the per-step scalars every N steps (--tensorboard-log-interval)."""
    tensorboard_queue_size: int = 1000
    """Pending events before the SummaryWriter flushes (--tensorboard-queue-size)."""
    log_timers_to_tensorboard: bool = False
    """Record <phase>-time, evaluate-time and save-checkpoint-time (--log-timers-to-tensorboard)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Record exp(validation loss) (--log-validation-ppl-to-tensorboard)."""
    log_memory_to_tensorboard: bool = False
    """Record CUDA memory statistics (--log-memory-to-tensorboard)."""
    log_loss_scale_to_tensorboard: bool = True
    """Record the loss scale (--no-log-loss-scale-to-tensorboard turns it off)."""
    log_world_size_to_tensorboard: bool = False
    """Record the number of processes (--log-world-size-to-tensorboard)."""
    log_batch_size_to_tensorboard: bool = False
    """Record the global batch size (--log-batch-size-to-tensorboard)."""
    log_learning_rate_to_tensorboard: bool = True
    """Record the learning rate (--no-log-learning-rate-to-tensorboard turns it off)."""
    wandb_run_id: Optional[str] = None
    """wandb.init(id=) (--wandb-run-id)."""
    wandb_mode: str = "online"
    """wandb.init(mode=): online, offline or disabled (--wandb-mode)."""
    wandb_tags: Optional[str] = None
    """Comma-separated wandb tags (--wandb-tags)."""
    wandb_group: Optional[str] = None
    """wandb.init(group=) (--wandb-group)."""
    wandb_notes: Optional[str] = None
    """wandb.init(notes=) (--wandb-notes)."""
    wandb_resume: str = "auto"
    """wandb.init(resume=) (--wandb-resume)."""
    wandb_resume_from: Optional[str] = None
    """wandb.init(resume_from=), '<run id>?_step=<step>' (--wandb-resume-from)."""
    wandb_save_dir: Optional[str] = None
    """wandb.init(dir=); <save>/wandb by default (--wandb-save-dir)."""
    wandb_entity: Optional[str] = None
    """wandb.init(entity=) (--wandb-entity)."""

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ValueError("--log-interval must be >= 1")


@dataclass
class ProfilingConfig(FromArgs):
    """--profile's torch-profiler window and the CUDA allocator history."""

    profile: bool = False
    """Trace the steps [profile_step_start, profile_step_end) (--profile)."""
    profile_step_start: int = 10
    """First traced step, as the iteration count before it (--profile-step-start)."""
    profile_step_end: int = 12
    """Tracing stops before this step (--profile-step-end)."""
    profile_ranks: tuple = (0,)
    """Global ranks that trace and record memory history (--profile-ranks)."""
    pytorch_profiler_collect_shapes: bool = False
    """Record operators' input shapes in the trace (--pytorch-profiler-collect-shapes)."""
    pytorch_profiler_collect_callstack: bool = False
    """Record operators' Python stacks in the trace (--pytorch-profiler-collect-callstack)."""
    record_memory_history: bool = False
    """Record CUDA allocations and dump snapshots every --log-interval (--record-memory-history)."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Snapshot path; the rank goes before the extension (--memory-snapshot-path)."""


@dataclass
class LMEvalConfig(FromArgs):
    """lm-eval tasks run on the live model during training (megatron/evaluation/in_loop.py)."""

    lm_eval_tasks: Optional[list] = None
    """Task or group names; None: no in-loop lm-eval (--lm-eval-tasks)."""
    lm_eval_interval: Optional[int] = None
    """Run them every N iterations and after the last (--lm-eval-interval, default --eval-interval)."""
    lm_eval_include_path: Optional[str] = None
    """A folder of task YAML files besides lm-eval's own (--lm-eval-include-path)."""
    lm_eval_limit: Optional[int] = None
    """Examples per task; None: all of them (--lm-eval-limit)."""
    lm_eval_model_args: Optional[str] = None
    """The megadlms model's options, key=value,... (--lm-eval-model-args)."""


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
