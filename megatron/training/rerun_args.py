"""The result-validation flags (Megatron-LM's rerun state machine) and the numerics logging flags.

Names, defaults and choices are Megatron-LM's (megatron/training/arguments.py and its
RerunStateMachineConfig); `--detect-anomaly` is MegaDLMs'. What they do: megatron/training/rerun.py.
"""

from __future__ import annotations

import argparse
import os
from typing import Collection

from megatron.training.rerun import RERUN_MODES, RerunConfig

INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


def add_rerun_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("result validation (re-run of anomalous steps)")
    g.add_argument("--rerun-mode", default="validate_results", choices=RERUN_MODES,
                   help="validate_results: a step whose loss or grad norm fails a check is re-run with the same "
                        "micro-batches and RNG states; a different result is a transient fault (training goes on "
                        "with the re-run's result), the same one a reproducible problem (a non-finite step's update "
                        "is skipped). report_stats: re-run the step of every --log-interval and report the "
                        "run-to-run variability of loss and grad norm. disabled: no re-runs.")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="Validate that the loss and the grad norm are finite (a non-finite step is always skipped; "
                        "this decides whether it is re-run, reported and recorded).")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="Validate that the loss stays below 10x the largest of its first 100 values.")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="Validate that the grad norm stays below 10x the largest of its first 100 values.")
    g.add_argument("--result-rejected-tracker-filename",
                   help="Append one line per rejected result and per re-run verdict to this file (rank 0).")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="Test the machine: treat about one step in N as having failed the finiteness check.")
    g.add_argument("--error-injection-type", default="transient_error", choices=INJECTION_TYPES,
                   help="How the re-run of an injected failure compares: transient_error differs (the update is "
                        "applied); persistent_error and correct_result reproduce (the update is skipped).")

    g = parser.add_argument_group("numerics logging and debugging")
    g.add_argument("--log-params-norm", action="store_true",
                   help="Log the L2 norm of all parameters (after the update), every element counted once.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Log how many gradient elements are exactly zero, every element counted once.")
    g.add_argument("--detect-anomaly", action="store_true",
                   help="Run forward and backward under torch.autograd.detect_anomaly (slow; a debugging aid): "
                        "a NaN produced in backward raises with the forward traceback of its operation.")


def validate_rerun_args(args: argparse.Namespace, given: Collection[str] = frozenset()) -> None:
    """Builds `args.rerun_config`; raises ValueError naming the flag and the fix."""
    if args.error_injection_rate < 0:
        raise ValueError(f"--error-injection-rate {args.error_injection_rate} must be >= 0 (0 disables injection)")
    path = args.result_rejected_tracker_filename
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or (
                os.path.exists(path) and not os.access(path, os.W_OK)):
            raise ValueError(f"--result-rejected-tracker-filename {path} cannot be written; "
                             "choose a file in an existing, writable directory")
    args.rerun_config = RerunConfig.from_args(args)


def _validates(args: argparse.Namespace) -> bool:
    return args.rerun_mode != "report_stats"


# (flag's dest, what it needs as typed, the test): rules for arguments.FLAG_NEEDS.
RERUN_FLAG_NEEDS = (
    ("check_for_spiky_loss", "--rerun-mode validate_results or disabled (report_stats only measures)", _validates),
    ("check_for_large_grads", "--rerun-mode validate_results or disabled (report_stats only measures)", _validates),
    ("check_for_nan_in_loss_and_grad", "--rerun-mode validate_results or disabled (report_stats only measures)",
     _validates),
    ("result_rejected_tracker_filename", "--rerun-mode validate_results or disabled (report_stats rejects nothing)",
     _validates),
    ("error_injection_rate", "--rerun-mode validate_results and --check-for-nan-in-loss-and-grad",
     lambda a: a.rerun_mode == "validate_results" and a.check_for_nan_in_loss_and_grad),
    ("error_injection_type", "--error-injection-rate > 0", lambda a: a.error_injection_rate > 0),
)
