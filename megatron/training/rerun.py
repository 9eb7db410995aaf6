"""Result validation by re-running a step (Megatron-LM's rerun state machine), and the numerics
the console line can report (params norm, zeros in the gradients).

Why re-run: a NaN or a spike in the loss is either a fault of the machine (a flipped bit, a bad
GPU: it does not come back when the same step is computed again) or a real property of the data
and weights (it does). Telling them apart needs the step computed twice from the same inputs: the
same micro-batches (replayed, not read again), the same RNG states (dropout), and the same
corruption, which is keyed by (seed, sample index) and so needs nothing.

The modes (`--rerun-mode`, Megatron's names and default):

* validate_results: after each step's one host sync, the checks run on the all-reduced loss and
  grad norm, so every rank takes the same decision without another collective. A failed check
  re-runs the step once. A different result is a transient fault: it is logged and training goes
  on with the re-run's result. The same result is reproducible: logged, and for the finiteness
  check the update is skipped (the loop's skip and --max-consecutive-nan-iterations). Megatron
  exits there (to re-run the step from a checkpoint on another GPU); like MegaDLMs' fork we keep
  training. The spike checks are non-fatal in Megatron: their step's update is applied either way.
* report_stats: the step of every --log-interval is re-run and the relative differences of its
  loss and grad norm are reported: the run-to-run variability of non-deterministic kernels, at
  1 / log-interval of Megatron's cost (it re-runs every step).
* disabled: no re-runs; failed checks are still logged (Megatron raises on a fatal one; we skip).

Where we differ from Megatron, and why: the checks look at the step's global loss and grad norm
(Megatron's at each rank's micro-batch loss sums and gradient buckets), which every rank already
holds after the existing sync, so no extra collective is needed; the first step is validated too
(Megatron waits for one update because it may checkpoint); there is no second re-run from a
checkpoint on another GPU, so an injected correct_result reproduces like a persistent_error; the
counts of transient and reproducible results restart with each run (as Megatron's do).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import random
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from megatron.core.optimizer.optimizer import per_kind_sums, sum_over_layout
from megatron.training.configs import FromArgs
from megatron.training.rng_state import capture_rng_state, restore_rng_state

RERUN_MODES = ("disabled", "validate_results", "report_stats")
SPIKE_FACTOR = 10.0
"""A loss (grad norm) at least this many times the reference maximum is a spike (Megatron's 10)."""
REFERENCE_SAMPLES = 100
"""The reference maximum is taken over the first this-many finite values (Megatron's 100)."""


@dataclass
class RerunConfig(FromArgs):
    """What is validated and how, and which numerics are logged (flags: rerun_args.py)."""

    rerun_mode: str = "validate_results"
    """disabled, validate_results or report_stats (--rerun-mode)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Validate that loss and grad norm are finite (--[no-]check-for-nan-in-loss-and-grad)."""
    check_for_spiky_loss: bool = False
    """Validate the loss against 10x its reference maximum (--check-for-spiky-loss)."""
    check_for_large_grads: bool = False
    """Validate the grad norm against 10x its reference maximum (--check-for-large-grads)."""
    result_rejected_tracker_filename: Optional[str] = None
    """Rank 0 appends a line per rejected result and per verdict (--result-rejected-tracker-filename)."""
    error_injection_rate: int = 0
    """About one step in N fails the finiteness check on purpose; 0: never (--error-injection-rate)."""
    error_injection_type: str = "transient_error"
    """How an injected failure's re-run compares (--error-injection-type)."""
    log_params_norm: bool = False
    """Log the parameters' L2 norm (--log-params-norm)."""
    log_num_zeros_in_grad: bool = False
    """Log the number of exactly-zero gradient elements (--log-num-zeros-in-grad)."""
    detect_anomaly: bool = False
    """Forward and backward under torch.autograd.detect_anomaly (--detect-anomaly)."""

    def validate(self) -> None:
        if self.rerun_mode not in RERUN_MODES:
            raise ValueError(f"--rerun-mode {self.rerun_mode} must be one of {', '.join(RERUN_MODES)}")


def relative_difference(first: float, second: float) -> float:
    """0 for identical results (NaN and NaN, inf and inf included), inf when only one is finite or
    they are different non-finite values, else |a - b| relative to their mean (Megatron's measure)."""
    if first == second or (math.isnan(first) and math.isnan(second)):
        return 0.0
    if not (math.isfinite(first) and math.isfinite(second)):
        return math.inf
    return abs(first - second) / (abs(first + second) / 2) if first + second else math.inf


class SpikeDetector:
    """A value is a spike when it is at least `factor` times the largest of the first `samples`
    finite values seen (Megatron's is_unexpectedly_large: the reference is fixed after them)."""

    def __init__(self, factor: float = SPIKE_FACTOR, samples: int = REFERENCE_SAMPLES) -> None:
        self.factor, self.samples = factor, samples
        self.seen, self.reference = 0, 0.0

    def __call__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False  # the finiteness check's business
        value = abs(value)
        if self.seen < self.samples:
            self.seen += 1
            self.reference = max(self.reference, value)
            return False
        return value >= self.reference * self.factor


@dataclass
class Check:
    """One validation of a step's result (Megatron's validate_result call)."""

    message: str
    fatal: bool
    """A reproduced failure skips the update (non-fatal ones are applied, as in Megatron)."""
    tolerance: float
    """Relative difference up to which a re-run counts as the same result."""
    value: Callable[[float, float], float]
    """(loss, grad norm) -> the value checked."""
    rejects: Callable[[float], bool]


@dataclass
class Verdict:
    rerun: bool = False
    """Compute the step again before deciding."""
    skip: bool = False
    nan: bool = False
    """Counts as a NaN iteration (and toward --max-consecutive-nan-iterations)."""


@dataclass
class Variability:
    """Relative run-to-run differences of one value (Megatron's QuickStats, summarised)."""

    differences: List[float] = field(default_factory=list)

    def record(self, difference: float) -> None:
        bisect.insort(self.differences, difference)

    def summary(self) -> str:
        values, n = self.differences, len(self.differences)
        identical = bisect.bisect_right(values, 0.0)
        quantiles = " ".join(f"p{q:g}= {values[min(n - 1, int(n * q / 100))]:.3E}" for q in (50, 90, 99))
        return (f"{n}/{identical} re-runs/identical, rel. variability: avg= {sum(values) / n:.3E} {quantiles} "
                f"max= {values[-1]:.3E}")


class Replay:
    """The step's micro-batches as read on its first execution, replayed on the re-run."""

    def __init__(self, source: Iterator) -> None:
        self.source, self.seen, self.position = source, [], None

    def __iter__(self) -> "Replay":
        return self

    def __next__(self):
        if self.position is None:
            self.seen.append(next(self.source))
            return self.seen[-1]
        self.position += 1
        return self.seen[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


def _fails(value: float) -> bool:
    return not math.isfinite(value)


class RerunMachine:
    """Validates every training step's result; one per Trainer (its counts feed the logs)."""

    def __init__(self, config: RerunConfig, fp16: bool, seed: int, log_interval: int,
                 print_fn: Callable[[str], None], is_main: bool, device: torch.device) -> None:
        self.config, self.log_interval, self.print, self.is_main = config, log_interval, print_fn, is_main
        self.device = device
        self.transient_errors = self.reproducible_errors = 0
        self.variability = {"loss": Variability(), "grad norm": Variability()}
        # The same draws on every rank: an injected failure is a decision all ranks share.
        injects = (config.error_injection_rate > 0 and config.rerun_mode == "validate_results"
                   and config.check_for_nan_in_loss_and_grad)
        self.injector = random.Random(seed) if injects else None
        self.checks: List[Check] = []
        if config.check_for_nan_in_loss_and_grad:
            self.checks.append(Check("non-finite loss", True, 0.0, lambda loss, norm: loss, _fails))
            if not fp16:  # under fp16 an inf gradient is an overflow the loss scaler handles
                self.checks.append(Check("non-finite grad norm", True, 1e-3, lambda loss, norm: norm, _fails))
        if config.check_for_spiky_loss:
            self.checks.append(Check("spiky loss", False, 0.0, lambda loss, norm: loss, SpikeDetector()))
        if config.check_for_large_grads:
            self.checks.append(Check("unexpectedly large grad norm", False, 1e-3, lambda loss, norm: norm,
                                     SpikeDetector()))
        self.fp16 = fp16

    # ------------------------------------------------------------------ hooks of the train step
    def begin_step(self, data_iterator: Iterator, model: nn.Module, iteration: int) -> "StepExecution":
        return StepExecution(self, data_iterator, model, iteration)

    def anomaly_mode(self):
        """torch.autograd.detect_anomaly with --detect-anomaly (MegaDLMs wraps training in it)."""
        return torch.autograd.detect_anomaly(check_nan=True) if self.config.detect_anomaly else contextlib.nullcontext()

    def logs(self, iteration: int) -> bool:
        """Whether the step that ends as `iteration` (1-based) is the one the logger prints."""
        return iteration % self.log_interval == 0

    def settle(self, loss: float, norm: float) -> Verdict:
        """The loop's rule: a non-finite loss or grad norm skips the update (under fp16 an
        overflowing gradient is the loss scaler's skip, not a NaN iteration)."""
        skip = not (math.isfinite(loss) and math.isfinite(norm))
        return Verdict(skip=skip, nan=not math.isfinite(loss) or (skip and not self.fp16))

    def first_failure(self, loss: float, norm: float) -> Optional[Tuple[Check, float, bool]]:
        """The first check the step's first result fails: (check, value, injected)."""
        if self.injector is not None and self.injector.randrange(self.config.error_injection_rate) == 0:
            check = self.checks[0]
            self.print(f" rerun: injecting a {self.config.error_injection_type.replace('_', ' ')} "
                       f"(--error-injection-rate {self.config.error_injection_rate})")
            return check, check.value(loss, norm), True
        for check in self.checks:
            value = check.value(loss, norm)
            if check.rejects(value):
                return check, value, False
        return None

    def record(self, iteration: int, status: str, value: float, message: str) -> None:
        """One line of --result-rejected-tracker-filename (Megatron's fields); rank 0 writes for all,
        since every rank took the same decision. The file is rewritten whole under a temporary name
        and renamed, so a crash never leaves a half-written line."""
        path = self.config.result_rejected_tracker_filename
        if not path or not self.is_main:
            return
        device = f"cuda:{torch.cuda.current_device()}" if self.device.type == "cuda" else "cpu"
        line = (f"ts={datetime.now()} node={socket.gethostname()} device={device} "
                f"jobID={os.environ.get('SLURM_JOBID', 'N/A')} rank=0 iteration={iteration} status={status} "
                f"result={value} message='{message}'\n")
        previous = ""
        if os.path.exists(path):
            with open(path) as existing:
                previous = existing.read()
        temporary = f"{path}.tmp.{os.getpid()}"
        with open(temporary, "w") as out:
            out.write(previous + line)
        os.replace(temporary, path)

    # ------------------------------------------------------------------ what the logs receive
    def report(self, zeros: Optional[int], params_norm: Optional[float]) -> "NumericsReport":
        scalars: Dict[str, float] = {}
        if self.config.rerun_mode == "validate_results":
            scalars.update({"rerun/transient-errors": self.transient_errors,
                            "rerun/reproducible-errors": self.reproducible_errors})
        for name, stats in self.variability.items():
            if stats.differences:
                scalars[f"rerun/{name.replace(' ', '-')}-variability-max"] = stats.differences[-1]
        return NumericsReport(zeros, params_norm, scalars)

    def count_zero_grads(self, model: nn.Module, groups: dict) -> Optional[int]:
        """Exactly-zero gradient elements of the whole model, each counted once across the layout."""
        if not self.config.log_num_zeros_in_grad:
            return None
        params = [p for p in model.parameters() if p.grad is not None]
        zeros = per_kind_sums(params, lambda p: p.grad, _count_zeros, self.device, dtype=torch.float64)
        return int(sum_over_layout(zeros, **groups))

    def params_norm(self, model: nn.Module, groups: dict) -> Optional[float]:
        """L2 norm of all parameters, each element counted once across the layout (a collective)."""
        if not self.config.log_params_norm:
            return None
        squares = per_kind_sums(list(model.parameters()), lambda p: p.detach(), _squares, self.device)
        return float(sum_over_layout(squares, **groups).sqrt())


def _count_zeros(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(t == 0).sum() for t in tensors]).sum().double()


def _squares(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


@dataclass
class NumericsReport:
    """What a logged step adds to the console line and the scalars."""

    num_zeros: Optional[int] = None
    params_norm: Optional[float] = None
    scalars: Dict[str, float] = field(default_factory=dict)

    def console_parts(self) -> List[str]:
        """Megatron's fields and order (after `grad norm`)."""
        parts = [] if self.num_zeros is None else [f"num zeros: {self.num_zeros}"]
        return parts + ([] if self.params_norm is None else [f"params norm: {self.params_norm:.3f}"])

    def all_scalars(self) -> Dict[str, float]:
        values = dict(self.scalars)
        if self.num_zeros is not None:
            values["num-zeros"] = self.num_zeros
        if self.params_norm is not None:
            values["params-norm"] = self.params_norm
        return values


@dataclass
class FirstResult:
    """The first execution of a step that is re-run: what failed (None: report_stats) and its numbers."""

    check: Optional[Check]
    value: float
    injected: bool
    loss: float
    norm: float


class StepExecution:
    """One training step and, when a check asks for it, its re-run."""

    def __init__(self, machine: RerunMachine, data_iterator: Iterator, model: nn.Module, iteration: int) -> None:
        self.machine, self.model, self.iteration = machine, model, iteration
        replays = machine.config.rerun_mode != "disabled"
        self.data = Replay(data_iterator) if replays else data_iterator
        self.rng = capture_rng_state(model) if replays else None
        """Every generator the forward and backward draw from (dropout, the tensor-parallel stream)."""
        self.first: Optional[FirstResult] = None

    def rewind(self) -> None:
        self.data.rewind()
        restore_rng_state(self.model, self.rng)

    def judge(self, loss: float, norm: float) -> Verdict:
        """The decision on this execution's (all-reduced, so rank-independent) loss and grad norm."""
        machine, mode = self.machine, self.machine.config.rerun_mode
        if self.first is not None:
            return self._judge_rerun(loss, norm)
        if mode == "report_stats":
            if machine.logs(self.iteration):
                self.first = FirstResult(None, 0.0, False, loss, norm)
                return Verdict(rerun=True)
            return machine.settle(loss, norm)
        failure = machine.first_failure(loss, norm)
        if failure is None:
            return machine.settle(loss, norm)
        check, value, injected = failure
        if mode == "disabled":
            machine.record(self.iteration, "rerun_disabled", value, check.message)
            action = "skipping this optimization step" if machine.settle(loss, norm).skip else "no re-run"
            machine.print(f" rerun disabled: iteration {self.iteration}: unexpected result {value} "
                          f"({check.message}); {action}")
            return machine.settle(loss, norm)
        machine.record(self.iteration, "initial_run", value, check.message)
        machine.print(f" rerun: iteration {self.iteration}: unexpected result {value} ({check.message}); "
                      "re-running the step with the same micro-batches and RNG states")
        self.first = FirstResult(check, value, injected, loss, norm)
        return Verdict(rerun=True)

    def _judge_rerun(self, loss: float, norm: float) -> Verdict:
        machine = self.machine
        first, check = self.first, self.first.check
        if check is None:  # report_stats
            for name, before, after in (("loss", first.loss, loss), ("grad norm", first.norm, norm)):
                machine.variability[name].record(relative_difference(before, after))
            machine.print(" rerun stats (report_stats): " + " | ".join(
                f"{name}: {stats.summary()}" for name, stats in machine.variability.items()))
            return machine.settle(loss, norm)
        value = check.value(loss, norm)
        if first.injected:  # the injected failure was never in the numbers: its type decides the comparison
            reproduced = machine.config.error_injection_type != "transient_error"
        else:
            reproduced = relative_difference(first.value, value) <= check.tolerance
        if not reproduced:
            machine.transient_errors += 1
            machine.record(self.iteration, "first_rerun_not_reproducible", value, check.message)
            machine.print(f" rerun: iteration {self.iteration}: the re-run gave {value}, not {first.value} "
                          f"({check.message}): not reproducible, a possible transient (hardware) fault; "
                          "going on with the re-run's result")
            return machine.settle(loss, norm)
        machine.reproducible_errors += 1
        machine.record(self.iteration, "first_rerun_reproducible", value, check.message)
        consequence = "skipping this optimization step" if check.fatal else "applying the update"
        machine.print(f" rerun: iteration {self.iteration}: the re-run reproduced {value} ({check.message}): "
                      f"a reproducible numeric problem, not a transient fault; {consequence}")
        if check.fatal:
            return Verdict(skip=True, nan=True)
        return machine.settle(loss, norm)
