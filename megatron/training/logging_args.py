"""Megatron-LM's logging, profiling and loop-utility flags beyond the basic logging group.

tensorboard and wandb details (arguments.py keeps --log-interval, --tensorboard-dir and
--wandb-project), the progress file, per-phase timers, the torch profiler, manual garbage
collection, emptying the CUDA cache and --skip-train. Names, defaults and meaning follow
Megatron-LM (and MegaDLMs for the wandb run flags); the configs in configs.py take the dests.
"""

from __future__ import annotations

import argparse
import os
from typing import Collection

_OUTPUT = "--tensorboard-dir or --wandb-project"


def _writes_scalars(args: argparse.Namespace) -> bool:
    return bool(args.tensorboard_dir or args.wandb_project)


# (flag's dest, what it needs as typed, the test): appended to arguments.FLAG_NEEDS.
LOGGING_FLAG_NEEDS = tuple(
    [(dest, _OUTPUT, _writes_scalars) for dest in (
        # (--no-log-loss-scale/learning-rate-to-tensorboard turn off what is on by default: harmless anywhere.)
        "log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
        "log_world_size_to_tensorboard", "log_batch_size_to_tensorboard", "tensorboard_log_interval")]
    + [("tensorboard_queue_size", "--tensorboard-dir", lambda a: bool(a.tensorboard_dir))]
    + [(dest, "--wandb-project", lambda a: bool(a.wandb_project)) for dest in (
        "wandb_run_id", "wandb_mode", "wandb_tags", "wandb_group", "wandb_notes", "wandb_resume",
        "wandb_resume_from", "wandb_save_dir", "wandb_entity")]
    + [("log_progress", "--save DIR (progress.txt is written there)", lambda a: bool(a.save)),
       ("timing_log_option", "--timing-log-level 1 or 2", lambda a: a.timing_log_level >= 1)]
    + [(dest, "--profile", lambda a: a.profile) for dest in (
        "profile_step_start", "profile_step_end", "profile_ranks",
        "pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack")]
    + [("memory_snapshot_path", "--record-memory-history", lambda a: a.record_memory_history)]
    + [(dest, "--manual-gc", lambda a: a.manual_gc) for dest in ("manual_gc_interval", "manual_gc_eval")]
)


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    _add_tensorboard_args(parser.add_argument_group("logging: tensorboard, timers and progress"))
    _add_wandb_args(parser.add_argument_group("logging: Weights & Biases (needs the wandb package)"))
    _add_profiling_args(parser.add_argument_group("profiling"))
    _add_loop_args(parser.add_argument_group("loop utilities"))


def _add_tensorboard_args(g) -> None:
    g.add_argument("--log-progress", action="store_true",
                   help="Append job throughput, floating-point operations, tokens and samples to progress.txt in "
                        "the --save directory when the job starts and at every save.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="Which phases are timed: 0 only the iteration (no overhead), 1 also forward-backward, "
                        "gradient sync and optimizer once per step, 2 also every data fetch and, in a pipeline, "
                        "each stage's forward-compute and backward-compute with its measured bubble (CUDA events, "
                        "no extra synchronisation). Levels 1 and 2 synchronise the device at each phase boundary "
                        "and print the times every --log-interval.")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="Timers on the console: the max over ranks, (min, max), or every rank's.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="Record the per-step scalars (loss, learning rate, grad norm, ...) every N steps.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="Pending tensorboard events before a write forces a flush to disk.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Record the phase timers (<name>-time, seconds per step, max over ranks), evaluate-time and "
                        "save-checkpoint-time.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also record exp(validation loss). For a diffusion running mode the loss is the ELBO bound, "
                        "so this is exp of a bound (an upper bound on perplexity), not a perplexity.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Record CUDA memory statistics (reserved, allocated, peak, allocation count); "
                        "nothing on CPU.")
    g.add_argument("--log-loss-scale-to-tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="Record the loss scale (1 without --fp16).")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Record the number of processes.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true", help="Record the global batch size.")
    g.add_argument("--log-learning-rate-to-tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="Record the learning rate.")


def _add_wandb_args(g) -> None:
    g.add_argument("--wandb-run-id", help="The wandb run id (with --wandb-resume, the run to continue).")
    g.add_argument("--wandb-mode", default="online", choices=["online", "offline", "disabled"],
                   help="online, offline (sync later with `wandb sync`) or disabled.")
    g.add_argument("--wandb-tags", help="Comma-separated tags of the run, e.g. 'dlm,1.7b'.")
    g.add_argument("--wandb-group", help="The wandb group of the run.")
    g.add_argument("--wandb-notes", help="Notes attached to the run.")
    g.add_argument("--wandb-resume", default="auto", choices=["auto", "allow", "must", "never"],
                   help="wandb's resume policy for --wandb-run-id.")
    g.add_argument("--wandb-resume-from", help="Fork history from '<run id>?_step=<step>' (wandb's resume_from).")
    g.add_argument("--wandb-save-dir", help="Where wandb writes its files (default: <--save>/wandb).")
    g.add_argument("--wandb-entity", help="The wandb entity (team or user) owning the project.")


def _add_profiling_args(g) -> None:
    g.add_argument("--profile", action="store_true",
                   help="Trace the steps [--profile-step-start, --profile-step-end) with the torch profiler: a "
                        "chrome trace rank-<rank>.json.gz in torch_profile/ beside --tensorboard-dir (in the "
                        "working directory without one), one ProfilerStep#<iteration> span per step.")
    g.add_argument("--profile-step-start", type=int, default=10, help="First profiled step (0-based iteration).")
    g.add_argument("--profile-step-end", type=int, default=12, help="Profiling stops before this step.")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="Global ranks that profile.")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="With --profile: record each operator's input shapes.")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="With --profile: record the Python call stack of each operator.")
    g.add_argument("--record-memory-history", action="store_true",
                   help="Record CUDA allocator history on the --profile-ranks and dump a snapshot every "
                        "--log-interval (open it at pytorch.org/memory_viz); nothing on CPU.")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="Snapshot file; the rank is added before the extension (snapshot_0.pickle).")


def _add_loop_args(g) -> None:
    g.add_argument("--manual-gc", action="store_true",
                   help="Disable Python's automatic garbage collection and collect on every rank at the same "
                        "steps (--manual-gc-interval) and around evaluations, so no rank stalls alone.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: collect after every N-th step (0: only around evaluations).")
    g.add_argument("--manual-gc-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="With --manual-gc: collect before and after each evaluation.")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="torch.cuda.empty_cache(): 1 after each step's forward-backward and each evaluation, "
                        "2 also after the optimizer step. Trades speed for less fragmentation; no-op on CPU.")
    g.add_argument("--skip-train", action="store_true",
                   help="Do not train: evaluate the loaded (or initial) weights on the validation set and exit.")


def validate_logging_args(args: argparse.Namespace, given: Collection[str] = frozenset()) -> None:
    """Ranges the flags' choices cannot express; fills --wandb-save-dir's default."""
    for dest, lowest in (("tensorboard_log_interval", 1), ("tensorboard_queue_size", 1),
                         ("manual_gc_interval", 0), ("profile_step_start", 0)):
        if getattr(args, dest) < lowest:
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(args, dest)} must be >= {lowest}")
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise ValueError(f"--profile-step-end {args.profile_step_end} must be greater than --profile-step-start "
                         f"{args.profile_step_start} (the steps [start, end) are traced)")
    if args.skip_train and not args.eval_iters:
        raise ValueError("--skip-train only evaluates, and --eval-iters is 0; give --eval-iters N > 0")
    if args.wandb_project and not args.wandb_save_dir and args.save:
        args.wandb_save_dir = os.path.join(args.save, "wandb")  # MegaDLMs' and Megatron's default
