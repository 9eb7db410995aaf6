"""A linear layer's working copy of its weight, as the layer's forward reads it
(`--cache-low-precision-weights`; weight_copies.py makes the copies and keeps them fresh).

A copy is a non-persistent buffer of the layer: `weight_low` in the compute dtype, or under
`--fp8-format` the three buffers of a `Float8Copy`. The layers (layers.py, float8_mlp.py, the
output layer's loss in gpt_model.py) ask `training_copy` for theirs, and the GEMMs that read one
(fp32_weight_grad.py, float8_matmul.py) take the `Float8Copy` as it is described here.
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Union

import torch
from torch import nn

from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, DelayedScales, to_float8

__all__ = ["BUFFER", "FLOAT8_BUFFERS", "Float8Copy", "cast_float8", "training_copy"]

BUFFER = "weight_low"
FLOAT8_BUFFERS = ("weight_fp8", "weight_fp8_t", "weight_fp8_inverse_scale")


class Float8Copy(NamedTuple):
    """A weight's float8 working copy: its layer's non-persistent buffers, and the gradients' dtype."""

    rows: torch.Tensor
    """[out, in] e4m3: the weight times the scale, for the forward GEMM."""
    columns: torch.Tensor
    """[in, out] e4m3, contiguous: the same values transposed, for the input gradient's GEMM."""
    inverse_scale: torch.Tensor
    """0-d fp32: what the GEMMs multiply the products back by (the weight's amax over e4m3's largest)."""
    gradient_dtype: torch.dtype
    delayed: Optional[DelayedScales] = None
    """The input's and output gradient's delayed scaling (`--fp8-recipe delayed`), in training."""


def _cast_float8(copies: List[Float8Copy], weights: List[torch.Tensor]) -> None:
    """Current scaling: each weight's float8 values in both layouts with its own amax."""
    for copy, weight in zip(copies, weights):
        values, inverse_scale = to_float8(weight, FORWARD_DTYPE)  # current scaling (float8_matmul.py)
        copy.rows.copy_(values)
        copy.columns.copy_(values.t())
        copy.inverse_scale.copy_(inverse_scale)


@functools.cache
def _compiled_cast_float8():
    return torch.compile(_cast_float8)  # memory-bound passes over every weight, fused per weight


def cast_float8(copies: List[Float8Copy], weights: List[torch.Tensor]) -> None:
    """Each weight into its float8 copy (compiled on CUDA: one graph for the whole list)."""
    if copies:
        with torch.no_grad():
            (_compiled_cast_float8() if weights[0].is_cuda else _cast_float8)(copies, [w.detach() for w in weights])


def training_copy(module: nn.Module) -> Union[None, torch.Tensor, Float8Copy]:
    """The layer's copy to read in this forward: only in training mode, where `refresh` keeps it fresh;
    in evaluation a float8 layer's weight is cast afresh, any other layer casts its own."""
    if hasattr(module, "float8_gradient_dtype"):
        buffers = [getattr(module, name) for name in FLOAT8_BUFFERS]
        delayed = (DelayedScales(module.fp8_scale, module.fp8_amax, module.fp8_delayed_ready, module.fp8_gradient_amax)
                   if hasattr(module, "fp8_scale") and module.training else None)
        copy = Float8Copy(*buffers, module.float8_gradient_dtype, delayed)
        if not module.training:
            copy = Float8Copy(*(torch.empty_like(b) for b in buffers), module.float8_gradient_dtype)
            cast_float8([copy], [module.weight])
        return copy
    return getattr(module, BUFFER, None) if module.training else None
