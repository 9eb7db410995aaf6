"""What the training loop records about a run and its steps: where a micro-batch sits (StepContext,
which forward steps key the corruption on), the run's progress (TrainState, what a resume needs
besides weights and optimizer) and one step's outcome (StepResult)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron.core.transformer.moe.balancing import RouterStepStats
from megatron.training.rerun import NumericsReport

__all__ = ["StepContext", "StepResult", "TrainState", "validation_stream"]


@dataclass
class StepContext:
    """Where a micro-batch sits in the run; forward steps key the corruption on it."""

    iteration: int
    first_sample_index: int
    """Stream index of the first sample of this global batch."""
    global_batch_size: int
    microbatch: int
    training: bool = True
    stream: int = 0
    """0 for training batches, validation_stream(draw) for validation (fixed draws at every evaluation)."""
    loss_scale: Optional[torch.Tensor] = None
    """fp16's current loss scale (None otherwise): forward steps multiply the MoE balancing losses'
    scale by it, as the schedule multiplies the loss (moe/aux_losses.py)."""
    schedule_iteration: int = 0
    """The step whose scheduled settings apply (DLMConfig.at_iteration: the block-size curriculum): the
    iteration itself in training; in evaluation, whose iteration keys fixed draws, the last trained step's."""


def validation_stream(draw: int) -> int:
    """The corruption stream of the validation set's draw `draw` (--difflm-eval-mc-samples): draw 0 is
    stream 1, the single draw of every evaluation so far; draw k > 0 puts k in the high 32-bit word, so
    no draw meets training's stream 0 or any other split's small stream number."""
    return 1 | (draw << 32)


@dataclass
class TrainState:
    """Progress of a run: everything a resumed run needs besides weights and optimizer."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_nan_iterations: int = 0


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    normalizer: float
    """What the step's loss sum was divided by (tokens, masked tokens or sequences)."""
    skipped: bool
    nan: bool
    moe: Optional[RouterStepStats] = None
    """The routers' balancing statistics of the step (MoE models)."""
    global_batch_size: int = 0
    """Samples of the step (it changes along --rampup-batch-size); 0: the configured one."""
    numerics: Optional[NumericsReport] = None
    """Logged steps: params norm, zero gradients and the re-run counts (rerun.py)."""
    parts: Dict[str, float] = field(default_factory=dict)
    """The loss's named terms (GlobalBatchLoss parts: the joint AR + DLM objective's), adding up to `loss`."""
