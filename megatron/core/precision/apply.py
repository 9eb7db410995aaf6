"""The precision converter: training precision applied to a built model from outside.

In the spirit of torchtitan's model converters: the model files build their layers with a plain GEMM
(`tensor_parallel/fp32_weight_grad.LinearGemm`, gradient-accumulation fusion being a construction
flag of the layers, as in Megatron's config) and never mention working copies or float8; `apply_precision`
takes the built (and data-parallel wrapped) model and a `PrecisionConfig` and swaps each layer's GEMM for
the one the config asks for: a bf16/fp16 working copy (working_copy.py), or float8 (../fp8/float8_copy.py)
with tensorwise or delayed scaling. It returns the `WeightCopies` (weight_copies.py) that the trainer
refreshes before each iteration, tells after each step (`end_iteration`) and checkpoints (`state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from megatron.core.fp8.float8_matmul import float8_gemms_on_cpu
from megatron.core.fp8.float8_scaling import DelayedScalingConfig
from megatron.core.precision.loss_scale import LossScaleConfig
from megatron.core.precision.weight_copies import WeightCopies

__all__ = ["PrecisionConfig", "apply_precision"]


@dataclass(frozen=True)
class PrecisionConfig:
    """The precision training applies from outside the model: working copies, float8 and fp16's loss
    scaling. What the model is built with (params_dtype, the bf16/fp16 autocast, gradient-accumulation
    fusion) is TransformerConfig's, where Megatron keeps it; the Adam moments' storage is OptimizerConfig's
    (Megatron's precision-aware optimizer) and the gradient reduction's DataParallelConfig's."""

    cache_low_precision_weights: bool = False
    """Linear layers read working copies of their weights, refreshed once per step
    (--cache-low-precision-weights; always on under --fp8-format)."""
    fp8_format: Optional[str] = None
    """Float8 linear layers in this format (--fp8-format)."""
    fp8_recipe: str = "tensorwise"
    """How the float8 scales are chosen (--fp8-recipe)."""
    fp8_delayed_scaling: Optional[DelayedScalingConfig] = None
    """--fp8-recipe delayed's amax history (--fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-margin)."""
    loss_scale: Optional[LossScaleConfig] = None
    """fp16's loss scaling (--fp16 with --initial-loss-scale, --loss-scale, ...); None under bf16 and fp32."""


def apply_precision(model: nn.Module, config: PrecisionConfig, compute_dtype: torch.dtype, optimizer=None,
                    groups: Sequence = ()) -> Optional[WeightCopies]:
    """Install `config` into `model` (after its data-parallel wrapper: the copies' buffers are not
    broadcast, and need not be, every rank writes its own): working copies in `compute_dtype`, float8 ones
    under `fp8_format`, written by each of this rank's `CompiledAdamW` steps in `optimizer` (the other
    optimizers leave them to `refresh`); delayed scaling's amaxes the largest over `groups`
    (float8_scaling.py). Returns the copies, or None where the config asks for none."""
    from megatron.core.optimizer.compiled_adamw import CompiledAdamW
    from megatron.core.optimizer.optimizer import local_optimizers

    if config.fp8_format is not None:
        float8_gemms_on_cpu(next(model.parameters()).device)
    if not (config.cache_low_precision_weights or config.fp8_format):
        return None
    copies = WeightCopies(model, compute_dtype, config.fp8_format, config.fp8_delayed_scaling, groups)
    for local in local_optimizers(optimizer) if optimizer is not None else ():
        if isinstance(local, CompiledAdamW):
            local.weight_copies = copies
    return copies
