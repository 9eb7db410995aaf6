"""Learning-rate schedules with Megatron-LM's semantics and flag names.

The schedule is a pure function of the step counter (`get_lr`), so a resumed run only
needs `num_steps` and the schedule parameters to continue exactly; `state_dict` holds plain
Python numbers and strings so checkpoints load with `weights_only=True`.

A "step" is whatever unit the caller advances by: Megatron counts samples (each iteration
calls `step(global_batch_size)`), iteration-based callers use `step(1)`. Warmup and decay
lengths must be given in the same unit.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")

# Fields that define the schedule, saved next to num_steps; values are plain numbers/strings.
_SCHEDULE_FIELDS = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps",
                    "lr_decay_style", "wsd_decay_steps", "lr_wsd_decay_style", "weight_decay")


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

    Param groups may carry "lr_mult" (e.g. a different lr for embeddings) and "wd_mult"
    (0 for norms and biases, which must not be decayed); both default to 1.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential",
                 weight_decay: float = 0.0) -> None:
        self.optimizer = optimizer
        self.num_steps = 0
        self._configure(max_lr=max_lr, min_lr=min_lr, init_lr=init_lr, lr_warmup_steps=lr_warmup_steps,
                        lr_decay_steps=lr_decay_steps, lr_decay_style=lr_decay_style,
                        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=lr_wsd_decay_style,
                        weight_decay=weight_decay)
        # Megatron writes the step-0 lr at construction so the first forward never sees the
        # optimizer's own default lr.
        self.step(0)

    def _configure(self, max_lr, min_lr, init_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                   wsd_decay_steps, lr_wsd_decay_style, weight_decay) -> None:
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
        self._validate()

    def _validate(self) -> None:
        """Raise one ValueError per bad setting, naming the Megatron flag to change."""
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
            raise ValueError(f"--lr-warmup-iters={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_steps <= 0:
            raise ValueError(f"--lr-decay-iters={self.lr_decay_steps} must be positive")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"--lr-warmup-iters exceeds --lr-decay-iters ({self.lr_warmup_steps} >= "
                             f"{self.lr_decay_steps}); warmup must end before decay ends")
        if self.lr_decay_style == "WSD" and (
                self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps):
            raise ValueError(f"--lr-wsd-decay-iters is required for WSD and must be <= --lr-decay-iters "
                             f"(got {self.wsd_decay_steps}, decay iters {self.lr_decay_steps}); "
                             "pass a positive --lr-wsd-decay-iters")

    def get_lr(self, step: Optional[int] = None) -> float:
        """Learning rate at `step` (default: the current step), before any group's lr_mult."""
        n = self.num_steps if step is None else step
        warmup = self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = self.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(self.min_lr, lr)
        if n > self.lr_decay_steps:
            return self.min_lr
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
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` steps and write the new lr and weight decay into every group."""
        self.num_steps += int(increment)
        lr = self.get_lr()
        # optimizer=None builds a detached schedule: flag validation and plotting use it.
        for group in (self.optimizer.param_groups if self.optimizer is not None else ()):
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        """The step counter and schedule parameters, as plain Python values (checkpoint-safe)."""
        state = {name: getattr(self, name) for name in _SCHEDULE_FIELDS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved schedule and re-write the lr of the restored step into the optimizer.

        The checkpoint's schedule wins over the constructor's, as a resumed run must continue
        the curve it started; a value that differs is logged so a changed flag is not silent.
        """
        missing = [name for name in (*_SCHEDULE_FIELDS, "num_steps") if name not in state]
        if missing:
            raise ValueError(f"scheduler state is missing {missing}; was it saved by OptimizerParamScheduler?")
        for name in _SCHEDULE_FIELDS:
            if state[name] != getattr(self, name):
                logger.warning("lr scheduler: using checkpoint %s=%r instead of %r",
                               name, state[name], getattr(self, name))
        previous = self.state_dict()
        try:
            self._configure(**{name: state[name] for name in _SCHEDULE_FIELDS})
        except ValueError:
            self._configure(**{name: previous[name] for name in _SCHEDULE_FIELDS})
            raise
        self.num_steps = int(state["num_steps"])
        self.step(0)
