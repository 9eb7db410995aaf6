"""Learning-rate schedules with Megatron-LM's semantics and flag names.

The schedule is a pure function of the step counter (`get_lr`), so a resumed run only
needs `num_steps` and the schedule parameters to continue exactly; `state_dict` holds plain
Python numbers and strings so checkpoints load with `weights_only=True`.

A "step" is whatever unit the caller advances by: Megatron counts samples (each iteration
calls `step(global_batch_size)`), iteration-based callers use `step(1)`. Warmup and decay
lengths must be given in the same unit; `unit` records which one ("iterations" or "samples"),
and `advance(global_batch_size)` makes the increment of one applied update in that unit.

Weight decay follows Megatron's increment schedule (start_wd -> end_wd over wd_incr_steps,
constant by default). A group may carry its own "max_lr" / "min_lr" (Megatron's decoupled
learning rate of the embedding and output layer): same curve, other end points.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
UNITS = ("iterations", "samples")

# Fields that define the schedule, saved next to num_steps; values are plain numbers/strings.
_SCHEDULE_FIELDS = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps",
                    "lr_decay_style", "wsd_decay_steps", "lr_wsd_decay_style", "weight_decay")
# Added later: a checkpoint without them counted iterations with a constant weight decay.
_LATER_FIELDS = ("unit", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def wsd_anneal_coefficient(style: str, ratio: float) -> float:
    """Fraction of (max_lr - min_lr) left after `ratio` in [0, 1] of the WSD anneal phase.

    All shapes go from 1 at ratio 0 to 0 at ratio 1; they differ in how fast they drop early.
    """
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"--lr-wsd-decay-style={style!r} is not one of {list(WSD_DECAY_STYLES)}")


class OptimizerParamScheduler:
    """Warmup then decay of the learning rate; writes lr and weight decay into the optimizer.

    Param groups may carry "lr_mult" (e.g. a different lr for embeddings), "wd_mult" (0 for
    norms and biases, which must not be decayed), and "max_lr" / "min_lr" (the decoupled lr);
    the multipliers default to 1 and the end points to the scheduler's.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential",
                 weight_decay: float = 0.0, unit: str = "iterations", start_wd: Optional[float] = None,
                 end_wd: Optional[float] = None, wd_incr_steps: Optional[int] = None,
                 wd_incr_style: str = "constant") -> None:
        self.optimizer = optimizer
        self.num_steps = 0
        self.num_updates = 0
        """Optimizer updates applied (AdamW's step count), whatever unit num_steps counts."""
        self._configure(max_lr=max_lr, min_lr=min_lr, init_lr=init_lr, lr_warmup_steps=lr_warmup_steps,
                        lr_decay_steps=lr_decay_steps, lr_decay_style=lr_decay_style,
                        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=lr_wsd_decay_style,
                        weight_decay=weight_decay, **self._later_defaults(
                            dict(unit=unit, start_wd=start_wd, end_wd=end_wd, wd_incr_steps=wd_incr_steps,
                                 wd_incr_style=wd_incr_style), weight_decay, lr_decay_steps))
        # Megatron writes the step-0 lr at construction so the first forward never sees the
        # optimizer's own default lr.
        self.step(0)

    @staticmethod
    def _later_defaults(given: dict, weight_decay: float, lr_decay_steps: int) -> dict:
        """`_LATER_FIELDS` with their defaults filled: iterations, a constant `weight_decay`."""
        defaults = dict(unit="iterations", start_wd=weight_decay, end_wd=weight_decay,
                        wd_incr_steps=lr_decay_steps, wd_incr_style="constant")
        return {name: defaults[name] if given.get(name) is None else given[name] for name in _LATER_FIELDS}

    def _configure(self, max_lr, min_lr, init_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                   wsd_decay_steps, lr_wsd_decay_style, weight_decay, unit, start_wd, end_wd, wd_incr_steps,
                   wd_incr_style) -> None:
        """Set the schedule parameters with plain Python types, then validate them."""
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = str(lr_decay_style)
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.lr_wsd_decay_style = str(lr_wsd_decay_style)
        self.weight_decay = float(weight_decay)
        self.unit = str(unit)
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = int(wd_incr_steps), str(wd_incr_style)
        self._validate()
        self._validate_weight_decay()

    def _validate(self) -> None:
        """Raise one ValueError per bad setting, naming the Megatron flag to change."""
        if self.unit not in UNITS:
            raise ValueError(f"scheduler unit {self.unit!r} is not one of {list(UNITS)}")
        per = "samples" if self.unit == "samples" else "iters"
        warmup, decay, wsd = f"--lr-warmup-{per}", f"--lr-decay-{per}", f"--lr-wsd-decay-{per}"
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style={self.lr_decay_style!r} is not one of {list(LR_DECAY_STYLES)}")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style={self.lr_wsd_decay_style!r} is not one of "
                             f"{list(WSD_DECAY_STYLES)}")
        if self.min_lr < 0.0:
            raise ValueError(f"--min-lr={self.min_lr} must be >= 0")
        if self.min_lr > self.max_lr:
            raise ValueError(f"--min-lr greater than --lr ({self.min_lr} > {self.max_lr}); lower --min-lr")
        if self.init_lr < 0.0:
            raise ValueError(f"--lr-warmup-init={self.init_lr} must be >= 0")
        if self.weight_decay < 0.0:
            raise ValueError(f"--weight-decay={self.weight_decay} must be >= 0")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"{warmup}={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_steps <= 0:
            raise ValueError(f"{decay}={self.lr_decay_steps} must be positive")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"{warmup} exceeds {decay} ({self.lr_warmup_steps} >= "
                             f"{self.lr_decay_steps}); warmup must end before decay ends")
        if self.lr_decay_style == "WSD" and (
                self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps):
            raise ValueError(f"{wsd} is required for WSD and must be <= {decay} "
                             f"(got {self.wsd_decay_steps}, decay {per} {self.lr_decay_steps}); "
                             f"pass a positive {wsd}")

    def _validate_weight_decay(self) -> None:
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"--weight-decay-incr-style={self.wd_incr_style!r} is not one of {list(WD_INCR_STYLES)}")
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"--start-weight-decay {self.start_wd} and --end-weight-decay {self.end_wd} must satisfy "
                             "0 <= start <= end")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError("--weight-decay-incr-style constant keeps one weight decay; pass linear or cosine to "
                             "go from --start-weight-decay to --end-weight-decay")
        if self.wd_incr_steps <= 0:
            raise ValueError(f"the weight-decay schedule needs a positive length (got {self.wd_incr_steps})")

    def get_lr(self, step: Optional[int] = None, max_lr: Optional[float] = None,
               min_lr: Optional[float] = None) -> float:
        """Learning rate at `step` (default: the current step), before any group's lr_mult;
        `max_lr` / `min_lr`: a group's own end points (default: the scheduler's)."""
        n = self.num_steps if step is None else step
        peak = self.max_lr if max_lr is None else max_lr
        floor = self.min_lr if min_lr is None else min_lr
        warmup = self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (peak - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return peak
        if self.lr_decay_style == "inverse-square-root":
            lr = peak * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(floor, lr)
        if n > self.lr_decay_steps:
            return floor
        decay_ratio = (n - warmup) / (self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = (n - anneal_start) / self.wsd_decay_steps
                coeff = wsd_anneal_coefficient(self.lr_wsd_decay_style, wsd_ratio)
        return floor + coeff * (peak - floor)

    def get_wd(self, step: Optional[int] = None) -> float:
        """Weight decay at `step` (Megatron's increment: start_wd -> end_wd over wd_incr_steps)."""
        n = self.num_steps if step is None else step
        if self.wd_incr_style == "constant" or n > self.wd_incr_steps:
            return self.end_wd
        ratio = n / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` steps and write the new lr and weight decay into every group."""
        self.num_steps += int(increment)
        wd = self.get_wd()
        # optimizer=None builds a detached schedule: flag validation and plotting use it.
        for group in (self.optimizer.param_groups if self.optimizer is not None else ()):
            group_lr = self.get_lr(max_lr=group.get("max_lr"), min_lr=group.get("min_lr"))
            group["lr"] = group_lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def advance(self, global_batch_size: int) -> None:
        """One applied optimizer update of `global_batch_size` samples, in this schedule's unit."""
        self.num_updates += 1
        self.step(global_batch_size if self.unit == "samples" else 1)

    def state_dict(self) -> dict:
        """The step counter and schedule parameters, as plain Python values (checkpoint-safe)."""
        state = {name: getattr(self, name) for name in (*_SCHEDULE_FIELDS, *_LATER_FIELDS)}
        state["num_steps"] = self.num_steps
        state["num_updates"] = self.num_updates
        return state

    def load_state_dict(self, state: dict, override: bool = False) -> None:
        """Restore a saved schedule and re-write the lr of the restored step into the optimizer.

        The checkpoint's schedule wins over the constructor's, as a resumed run must continue
        the curve it started; a value that differs is logged so a changed flag is not silent.
        `override` (Megatron's --override-opt-param-scheduler): keep the constructor's schedule and
        restore only the position on it. Checkpoints from before `_LATER_FIELDS` counted
        iterations, with a constant weight decay.
        """
        missing = [name for name in (*_SCHEDULE_FIELDS, "num_steps") if name not in state]
        if missing:
            raise ValueError(f"scheduler state is missing {missing}; was it saved by OptimizerParamScheduler?")
        saved = {name: state[name] for name in _SCHEDULE_FIELDS}
        saved.update(self._later_defaults({name: state.get(name) for name in _LATER_FIELDS},
                                          state["weight_decay"], state["lr_decay_steps"]))
        if override:
            if saved["unit"] != self.unit:
                raise ValueError(f"--override-opt-param-scheduler: the checkpoint's schedule counts {saved['unit']} "
                                 f"and this run's counts {self.unit}; use the same --train-iters/--train-samples kind")
            saved = {name: getattr(self, name) for name in saved}
        for name, value in saved.items():
            if value != getattr(self, name):
                logger.warning("lr scheduler: using checkpoint %s=%r instead of %r", name, value, getattr(self, name))
        previous = self.state_dict()
        try:
            self._configure(**saved)
        except ValueError:
            self._configure(**{name: previous[name] for name in saved})
            raise
        self.num_steps = int(state["num_steps"])
        # Older checkpoints counted iterations, one per applied update.
        self.num_updates = int(state.get("num_updates", state["num_steps"]))
        self.step(0)
