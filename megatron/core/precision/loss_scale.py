"""fp16's loss scale, by Megatron-LM's rules, on top of torch's GradScaler.

GradScaler multiplies the loss, unscales the gradients and finds overflows; this class only
decides the next scale (`GradScaler.update(new_scale=...)`), as Megatron's grad scalers do:

- static (`--loss-scale S`): always S; an overflowing step is skipped, the scale stays;
- dynamic (from `--initial-loss-scale`): after `--hysteresis` overflowing steps (not necessarily
  in a row) the scale halves, never below `--min-loss-scale`; after `--loss-scale-window` clean
  steps in a row it doubles and the hysteresis budget refills.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16's loss scaling (PrecisionConfig.loss_scale: present exactly under --fp16)."""

    initial_loss_scale: float = 2.0 ** 16
    """The first dynamic scale (--initial-loss-scale)."""
    loss_scale: Optional[float] = None
    """A static scale; None: dynamic (--loss-scale)."""
    min_loss_scale: float = 1.0
    """The dynamic scale never halves below this (--min-loss-scale)."""
    loss_scale_window: int = 1000
    """Clean steps in a row before the dynamic scale doubles (--loss-scale-window)."""
    hysteresis: int = 2
    """Overflowing steps before the dynamic scale halves (--hysteresis)."""


@dataclass
class LossScaleState:
    growth_tracker: int = 0
    """Clean steps in a row since the last change."""
    hysteresis_tracker: int = 2
    """Overflows left before the scale halves."""


class LossScale:
    @classmethod
    def build(cls, config: Optional[LossScaleConfig], device: torch.device) -> "LossScale":
        """The scale of `config` on `device`; None (not fp16): a disabled GradScaler, scale 1."""
        enabled = config is not None
        config = config or LossScaleConfig()
        scaler = torch.amp.GradScaler(device.type, init_scale=config.loss_scale or config.initial_loss_scale,
                                      enabled=enabled)
        return cls(scaler, config.loss_scale, config.min_loss_scale, config.loss_scale_window, config.hysteresis,
                   device)

    def __init__(self, scaler: torch.amp.GradScaler, static: Optional[float] = None, min_scale: float = 1.0,
                 window: int = 1000, hysteresis: int = 2, device: torch.device = torch.device("cpu")) -> None:
        self.scaler, self.static, self.min_scale, self.device = scaler, static, min_scale, device
        self.window, self.hysteresis = window, hysteresis
        self.state = LossScaleState(hysteresis_tracker=hysteresis)

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` = its unscaled gradients were not finite (the step was skipped)."""
        if not self.scaler.is_enabled():
            return
        scale, state = self.scaler.get_scale(), self.state
        if self.static is not None:
            scale = self.static
        elif overflow:
            state.growth_tracker = 0
            state.hysteresis_tracker -= 1
            if state.hysteresis_tracker <= 0:
                scale = max(scale / 2.0, self.min_scale)
        else:
            state.growth_tracker += 1
            if state.growth_tracker == self.window:
                state.growth_tracker, state.hysteresis_tracker = 0, self.hysteresis
                scale = scale * 2.0
        self._set(scale)

    def _set(self, scale: float) -> None:
        if self.scaler._scale is None:  # GradScaler creates its scale at the first scale() call
            self.scaler.scale(torch.ones((), device=self.device))
        self.scaler.update(new_scale=float(scale))

    def state_dict(self) -> dict:
        return {"scale": self.scaler.get_scale(), **asdict(self.state)}

    def load_state_dict(self, saved: dict) -> None:
        self.state = LossScaleState(int(saved.get("growth_tracker", 0)),
                                    int(saved.get("hysteresis_tracker", self.hysteresis)))
        self._set(self.static if self.static is not None else saved["scale"])
