"""A linear layer's GEMM in float8 from a float8 working copy of its weight (`--fp8-format`).

The precision converter (../precision/apply.py) gives each decoder linear layer whose dimensions are
multiples of 16 a `Float8Gemm` in place of its `LinearGemm`: the weight in e4m3 twice (row-major for the
forward GEMM, transposed for the input gradient's) with its inverse scale, non-persistent buffers that
the refresh (../precision/weight_copies.py) casts once an iteration with the weight's own amax
(`cast_float8`). A training forward runs all three GEMMs in float8 (float8_matmul.float8_linear);
evaluation casts the weight afresh. With `--fp8-recipe delayed`, `DelayedScaling` (float8_scaling.py)
gives the GEMM its row of the scales and running amaxes (`use_delayed_scaling`).
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional

import torch

from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, DelayedScales, float8_linear, float8_ready, to_float8
from megatron.core.tensor_parallel.fp32_weight_grad import LinearGemm, linear

__all__ = ["Float8Copy", "Float8Gemm", "cast_float8"]


class Float8Copy(NamedTuple):
    """A weight's float8 working copy as the GEMMs read it, and the gradients' dtype."""

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


class Float8Gemm(LinearGemm):
    """`LinearGemm` in float8 from the weight's float8 copy (see the module); where `x`'s rows are not a
    multiple of 16, or outside autocast, the layer's bf16 GEMM without a copy."""

    def __init__(self, weight: torch.Tensor, gradient_dtype: torch.dtype, fp32_weight_grad: bool = True) -> None:
        super().__init__(fp32_weight_grad)
        out_features, in_features = weight.shape
        self.register_buffer("rows", torch.empty_like(weight, dtype=FORWARD_DTYPE), persistent=False)
        self.register_buffer("columns", weight.new_empty((in_features, out_features), dtype=FORWARD_DTYPE),
                             persistent=False)
        self.register_buffer("inverse_scale", weight.new_ones((), dtype=torch.float32), persistent=False)
        self.gradient_dtype = gradient_dtype
        self.delayed_scaling = False
        """Whether `use_delayed_scaling` gave it delayed scales (then `delayed_ready` says if they are set)."""
        self.delayed_ready = False  # a Python flag: compiled layers guard on it

    def use_delayed_scaling(self, scales: torch.Tensor, amax: torch.Tensor, gradient_amax: torch.Tensor) -> None:
        """Cast the input and output gradient by `scales` ([2], once `delayed_ready`), raising the running
        `amax` [2]; `gradient_amax`: the leaf whose gradient carries the output gradient's amax out."""
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("amax", amax, persistent=False)
        self.gradient_amax = gradient_amax
        self.delayed_scaling = True

    def stored_copy(self) -> Float8Copy:
        """The refresh's copy: the buffers, without delayed scaling."""
        return Float8Copy(self.rows, self.columns, self.inverse_scale, self.gradient_dtype)

    def float8_copy(self, weight: torch.Tensor) -> Float8Copy:
        """The copy this forward reads: in training the stored one (with delayed scaling where on); in
        evaluation `weight` cast afresh."""
        if not self.training:
            copy = Float8Copy(*(torch.empty_like(b) for b in (self.rows, self.columns, self.inverse_scale)),
                              self.gradient_dtype)
            cast_float8([copy], [weight])
            return copy
        delayed = (DelayedScales(self.scales, self.amax, self.delayed_ready, self.gradient_amax)
                   if self.delayed_scaling else None)
        return Float8Copy(self.rows, self.columns, self.inverse_scale, self.gradient_dtype, delayed)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                grad_into: Optional[torch.Tensor]) -> torch.Tensor:
        device = x.device.type
        if (self.fp32_weight_grad and weight.dtype == torch.float32 and torch.is_autocast_enabled(device)
                and float8_ready(x)):
            return float8_linear(x, weight, bias, self.float8_copy(weight), torch.get_autocast_dtype(device),
                                 grad_into)
        return linear(x, weight, bias, self.fp32_weight_grad, None, grad_into)
