"""Batch-size ramp-up, sample-based LR lengths, the decoupled LR and the weight-decay schedule.

Megatron-LM's flags and rules:
* `--train-samples` makes the run and its LR schedule count samples (each step advances the
  scheduler by its global batch), so with a batch ramp the LR still follows the data seen; the
  lengths are then `--lr-warmup-samples`, `--lr-decay-samples` (default: --train-samples) and
  `--lr-wsd-decay-samples`, and the `-iters` ones are refused, as Megatron asserts.
* `--rampup-batch-size` and `--step-batch-size-schedule` work with either: with `--train-iters` the
  run is that many steps of the scheduled batch and the LR counts iterations. (Megatron-LM refuses a
  ramp with --train-iters, although its own GPT-3 175B example script passes both.)
* `--train-iters` keeps the schedule in iterations (bit-identical to a run without these flags).
"""

from __future__ import annotations

import argparse

from megatron.training.batch_schedule import BatchSchedule

# Iteration-based LR lengths and their sample-based counterparts (dest, default).
_LENGTHS = (("lr_warmup_iters", 0, "lr_warmup_samples", 0), ("lr_decay_iters", None, "lr_decay_samples", None),
            ("lr_wsd_decay_iters", None, "lr_wsd_decay_samples", None))


def add_schedule_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batch-size ramp-up, sample-based schedule, decoupled LR, weight-decay schedule")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCR", "SAMPLES"),
                   help="Grow the global batch from START by INCR up to --global-batch-size over SAMPLES consumed "
                        "samples, in equal sample intervals (e.g. 16 8 300000 with 1024: 126 increments of about "
                        "2380 samples). Needs --train-samples.")
    g.add_argument("--step-batch-size-schedule",
                   help="Global batch size by tokens consumed: \"THRESHOLD:SIZE ...\" (e.g. "
                        "\"0:16 2.4B:320 12B:1536\"; K/M/B/T suffixes; thresholds divided by --seq-length into "
                        "samples; the first is 0). The last size is the global batch size.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Linear warmup, in samples (--train-samples).")
    g.add_argument("--lr-decay-samples", type=int,
                   help="Samples over which to decay the LR (default --train-samples).")
    g.add_argument("--lr-wsd-decay-samples", type=int, help="Length of the WSD anneal phase, in samples.")
    g.add_argument("--decoupled-lr", type=float,
                   help="Separate peak learning rate for the input embedding and the output layer (same schedule).")
    g.add_argument("--decoupled-min-lr", type=float,
                   help="Floor of the decoupled learning rate (default --min-lr).")
    g.add_argument("--start-weight-decay", type=float, help="Weight decay at the start of the run.")
    g.add_argument("--end-weight-decay", type=float, help="Weight decay at the end of the run.")
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
                   help="How weight decay goes from --start- to --end-weight-decay (constant: --weight-decay).")


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def batch_schedule_from_args(args: argparse.Namespace) -> BatchSchedule:
    return BatchSchedule.from_flags(args.global_batch_size, args.rampup_batch_size, args.step_batch_size_schedule,
                                    args.seq_length)


def resolve_batch_sizes(args: argparse.Namespace) -> None:
    """--global-batch-size (defaulted, or the step schedule's last size) and every size the run can
    use, each divisible by micro-batch x data-parallel; args.num_microbatches of the final size."""
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.step_batch_size_schedule is not None:
        if args.rampup_batch_size is not None:
            raise ValueError("--step-batch-size-schedule and --rampup-batch-size are exclusive; choose one")
        final = BatchSchedule.from_flags(0, None, args.step_batch_size_schedule, args.seq_length).final
        if args.global_batch_size not in (None, final):
            raise ValueError(f"--global-batch-size {args.global_batch_size} differs from the last size {final} of "
                             "--step-batch-size-schedule; drop --global-batch-size")
        args.global_batch_size = final
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    schedule = batch_schedule_from_args(args)
    flag = "--rampup-batch-size" if args.rampup_batch_size is not None else "--step-batch-size-schedule"
    for size in schedule.sizes():
        if size % per_step:
            what = f"{flag} reaches global batch size {size}, which" if schedule.varies else \
                f"--global-batch-size {size}"
            raise ValueError(f"{what} is not divisible by --micro-batch-size {args.micro_batch_size} x data-parallel "
                             f"size {args.data_parallel_size}; adjust one of them")
    args.num_microbatches = args.global_batch_size // per_step


def check_microbatches_per_size(args: argparse.Namespace) -> None:
    """The interleaved pipeline schedule needs every step's micro-batch count divisible by the stages."""
    pp, per_step = args.pipeline_model_parallel_size, args.micro_batch_size * args.data_parallel_size
    if not args.virtual_pipeline_model_parallel_size:
        return
    for size in batch_schedule_from_args(args).sizes():
        if (size // per_step) % pp:
            raise ValueError(f"the batch schedule reaches global batch size {size}: {size // per_step} micro-batches "
                             f"per replica, which the interleaved schedule needs divisible by "
                             f"--pipeline-model-parallel-size {pp}; use sizes that are multiples of {per_step * pp}")


def resolve_run_length(args: argparse.Namespace) -> None:
    """train_iters, and the LR lengths in the unit the schedule counts (samples with --train-samples)."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise ValueError("give exactly one of --train-iters and --train-samples")
    by_samples = args.train_samples is not None
    for iters, iters_default, samples, samples_default in _LENGTHS:
        wrong, default, right = (iters, iters_default, samples) if by_samples else (samples, samples_default, iters)
        if getattr(args, wrong) != default:
            unit = "samples (--train-samples)" if by_samples else "iterations (--train-iters)"
            raise ValueError(f"{_flag(wrong)} does not apply: the schedule counts {unit}; use {_flag(right)}")
    suffix = "samples" if by_samples else "iters"
    if by_samples:
        args.train_iters = batch_schedule_from_args(args).iterations_for(args.train_samples)
    if args.train_iters < 1:
        raise ValueError(f"--train-iters {args.train_iters} must be >= 1")
    decay = f"lr_decay_{suffix}"
    if getattr(args, decay) is None:
        setattr(args, decay, args.train_samples if by_samples else args.train_iters)
    if args.lr_warmup_fraction is not None:
        if getattr(args, f"lr_warmup_{suffix}"):
            raise ValueError(f"give only one of --lr-warmup-{suffix} and --lr-warmup-fraction")
        setattr(args, f"lr_warmup_{suffix}", int(args.lr_warmup_fraction * getattr(args, decay)))
    _validate_weight_decay_and_decoupled_lr(args)


def _validate_weight_decay_and_decoupled_lr(args: argparse.Namespace) -> None:
    for dest in ("lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples"):
        value = getattr(args, dest)
        if value is not None and value < (0 if dest == "lr_warmup_samples" else 1):
            raise ValueError(f"{_flag(dest)} {value} must be >= {0 if dest == 'lr_warmup_samples' else 1}")
    for dest in ("decoupled_lr", "decoupled_min_lr", "start_weight_decay", "end_weight_decay"):
        value = getattr(args, dest)
        if value is not None and not 0.0 <= value < float("inf"):
            raise ValueError(f"{_flag(dest)} {value} must be a finite number >= 0")
    if args.weight_decay_incr_style != "constant":
        if args.start_weight_decay is None or args.end_weight_decay is None:
            raise ValueError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                             "and --end-weight-decay")
        if args.end_weight_decay < args.start_weight_decay:
            raise ValueError(f"--end-weight-decay {args.end_weight_decay} is below --start-weight-decay "
                             f"{args.start_weight_decay}; Megatron's schedule only increases weight decay")
    if args.decoupled_lr is not None:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if floor > args.decoupled_lr:
            source = "--min-lr" if args.decoupled_min_lr is None else "--decoupled-min-lr"
            raise ValueError(f"{source} {floor} exceeds --decoupled-lr {args.decoupled_lr}: the embedding and output "
                             "layer's learning rate would grow as it decays; lower it (or pass --decoupled-min-lr)")


def schedule_kwargs(args: argparse.Namespace) -> dict:
    """OptimizerParamScheduler's arguments: lengths in samples with --train-samples, else iterations."""
    suffix = "samples" if args.train_samples is not None else "iters"
    constant = args.weight_decay_incr_style == "constant"
    return dict(max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=getattr(args, f"lr_warmup_{suffix}"),
                lr_decay_steps=getattr(args, f"lr_decay_{suffix}"), lr_decay_style=args.lr_decay_style,
                init_lr=args.lr_warmup_init, wsd_decay_steps=getattr(args, f"lr_wsd_decay_{suffix}"),
                lr_wsd_decay_style=args.lr_wsd_decay_style, weight_decay=args.weight_decay,
                unit="samples" if suffix == "samples" else "iterations",
                start_wd=args.weight_decay if constant else args.start_weight_decay,
                end_wd=args.weight_decay if constant else args.end_weight_decay,
                wd_incr_steps=args.train_samples if suffix == "samples" else args.train_iters,
                wd_incr_style=args.weight_decay_incr_style)


# Flags that act only with another setting (arguments.FLAG_NEEDS).
SCHEDULE_FLAG_NEEDS = (
    ("lr_wsd_decay_samples", "--lr-decay-style WSD", lambda a: a.lr_decay_style == "WSD"),
    ("decoupled_min_lr", "--decoupled-lr", lambda a: a.decoupled_lr is not None),
    ("start_weight_decay", "--weight-decay-incr-style linear or cosine",
     lambda a: a.weight_decay_incr_style != "constant"),
    ("end_weight_decay", "--weight-decay-incr-style linear or cosine",
     lambda a: a.weight_decay_incr_style != "constant"),
)
