"""The SwiGLU MLP of two float8 layers as one autograd function: fc1 -> SwiGLU -> fc2, each GEMM in
float8 from the weights' float8 copies (`--cache-low-precision-weights` under `--fp8-format`).

Layer by layer (float8_matmul.float8_linear each side of the activation) the activation is written in
16 bits by SwiGLU and read back by fc2's cast, and SwiGLU's input gradient is written in 16 bits by its
backward and read back by fc1's cast. Here, where the scales are given (delayed scaling, once ready) and
Triton runs, SwiGLU and those casts are one kernel each way (fused_float8_swiglu.py) and neither 16-bit
tensor exists. Elsewhere (the tensorwise recipe, delayed scaling's first iteration, no Triton) the same
function runs SwiGLU and the casts one after the other, as the layers would. Values, gradients and the
recorded amaxes are the layer-by-layer path's (tests/unit_tests/test_float8_mlp.py).

`MLP.forward` calls `swiglu_mlp`, which runs it for a gated SiLU MLP without fc1 bias whose two layers
both run in float8 and returns None otherwise; the tensor-parallel communication around it stays the
layers' own (fc1's input gather, fc2's reduction and bias).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions import fused_float8_swiglu
from megatron.core.fp8.float8_matmul import (FORWARD_DTYPE, backward_gemms, cast_both_layouts,
                                                         delayed_arguments, float8_ready, forward_gemm,
                                                         raise_amax)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.fusions import fused_swiglu


def _kernels_run(h: torch.Tensor, scale: Optional[torch.Tensor], fused: bool) -> bool:
    return scale is not None and fused and fused_float8_swiglu.available(h)


def _swiglu_cast(h: torch.Tensor, scale: Optional[torch.Tensor], fused: bool):
    """fc2's cast input from fc1's output: (values, values transposed, inverse scale, amax)."""
    if _kernels_run(h, scale, fused):
        rows, columns, amax = fused_float8_swiglu.swiglu_cast(h, scale, FORWARD_DTYPE)
        return rows, columns, scale.reciprocal(), amax
    activation = fused_swiglu.swiglu(h) if fused and fused_swiglu.available(h) else fused_swiglu.reference(h)
    return cast_both_layouts(activation, FORWARD_DTYPE, scale)


def _swiglu_backward_cast(grad: torch.Tensor, h: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor],
                          fused: bool):
    """fc1's cast output gradient from the activation's gradient and fc1's output."""
    if _kernels_run(h, scale, fused):
        rows, columns, amax = fused_float8_swiglu.swiglu_backward_cast(grad, h, scale, dtype)
        return rows, columns, scale.reciprocal(), amax
    kernel = fused and fused_swiglu.available(h)
    backward = fused_swiglu.swiglu_backward if kernel else fused_swiglu.reference_backward
    return cast_both_layouts(backward(grad, h), dtype, scale)


GRADIENT_AMAX_INPUTS = (14, 15)
"""`_Float8SwiGLUMLP.forward`'s argument indices (after ctx) of fc1's and fc2's `gradient_amax`."""


class _Float8SwiGLUMLP(torch.autograd.Function):
    """fc2(swiglu(fc1(x))) with all six GEMMs in float8 (float8_matmul.float8_linear's recipe for each
    layer), from each weight's float8 copy (rows, columns, inverse scale). Returns the output and the
    amaxes of fc1's and fc2's inputs; the output gradients' amaxes leave as the gradients of the leaves
    `gradient_amax1` and `gradient_amax2` (see float8_matmul._Float8Linear)."""

    @staticmethod
    def forward(ctx, x, weight1, weight2, rows1, columns1, inverse1, rows2, columns2, inverse2, out_dtype,
                gradient_dtype, fused, scales1, scales2, gradient_amax1, gradient_amax2, grad_into1=None,
                grad_into2=None):
        del weight1, weight2  # their gradients: what the backward returns (or adds into grad_into*); values: copies
        ctx.out_dtype, ctx.gradient_dtype, ctx.fused, ctx.scales = out_dtype, gradient_dtype, fused, (scales1, scales2)
        ctx.grad_into = grad_into1, grad_into2
        with torch.autocast(x.device.type, enabled=False):  # every dtype here is explicit
            flat = x.reshape(-1, x.shape[-1]).to(out_dtype)
            x8, x8_t, x_inverse, x_amax = cast_both_layouts(flat, FORWARD_DTYPE, _scale(scales1, 0))
            h = forward_gemm(x8, x_inverse, rows1, inverse1, out_dtype)
            a8, a8_t, a_inverse, a_amax = _swiglu_cast(h, _scale(scales2, 0), fused)
            output = forward_gemm(a8, a_inverse, rows2, inverse2, out_dtype)
        ctx.save_for_backward(x8_t, x_inverse, columns1, inverse1, h, a8_t, a_inverse, columns2, inverse2)
        ctx.mark_non_differentiable(x_amax, a_amax)
        return output.reshape(*x.shape[:-1], rows2.shape[0]), x_amax, a_amax

    @staticmethod
    def backward(ctx, grad_output, grad_x_amax, grad_a_amax):
        del grad_x_amax, grad_a_amax  # not differentiable
        x8_t, x_inverse, columns1, inverse1, h, a8_t, a_inverse, columns2, inverse2 = ctx.saved_tensors
        (scales1, scales2), dtype = ctx.scales, ctx.gradient_dtype
        flat = grad_output.reshape(-1, grad_output.shape[-1]).to(ctx.out_dtype)
        grad8, grad8_t, grad_inverse, amax2 = cast_both_layouts(flat, dtype, _scale(scales2, 1))
        grad_a, grad_weight2 = backward_gemms((grad8, grad8_t, grad_inverse), (columns2, inverse2),
                                              (a8_t, a_inverse), ctx.out_dtype, ctx.grad_into[1])
        grad_h8, grad_h8_t, grad_h_inverse, amax1 = _swiglu_backward_cast(grad_a, h, dtype, _scale(scales1, 1),
                                                                          ctx.fused)
        grad_x, grad_weight1 = backward_gemms((grad_h8, grad_h8_t, grad_h_inverse), (columns1, inverse1),
                                              (x8_t, x_inverse), ctx.out_dtype, ctx.grad_into[0])
        amaxes = [amax.reshape(1) if ctx.needs_input_grad[index] else None
                  for amax, index in zip((amax1, amax2), GRADIENT_AMAX_INPUTS)]
        return (grad_x.reshape(*grad_output.shape[:-1], columns1.shape[0]), grad_weight1, grad_weight2,
                *[None] * 11, *amaxes, None, None)


def _scale(scales: Optional[torch.Tensor], index: int) -> Optional[torch.Tensor]:
    return None if scales is None else scales[index]


def _copies(fc1, fc2, x: torch.Tensor, config):
    """The two layers' float8 copies where the fused function runs this MLP: tensor-parallel layers,
    gated SiLU, no fc1 bias, both layers float8 under autocast (where each layer's `Float8Gemm`
    would run it in float8) and `x`'s rows aligned before fc1's gather (so after it too); else None."""
    if not (isinstance(fc1, ColumnParallelLinear) and isinstance(fc2, RowParallelLinear) and fc2.input_is_parallel):
        return None
    if fc1.bias is not None or fc1.gather_output:
        return None
    if not (config.gated_linear_unit and config.activation == "silu" and float8_ready(x)):
        return None
    if not (isinstance(fc1.gemm, Float8Gemm) and isinstance(fc2.gemm, Float8Gemm)):
        return None
    if not (fc1.gemm.fp32_weight_grad and fc2.gemm.fp32_weight_grad and torch.is_autocast_enabled(x.device.type)):
        return None
    weights_fp32 = fc1.weight.dtype == fc2.weight.dtype == torch.float32
    return (fc1.gemm.float8_copy(fc1.weight), fc2.gemm.float8_copy(fc2.weight)) if weights_fp32 else None


def swiglu_mlp(hidden: torch.Tensor, fc1, fc2, config) -> Optional[torch.Tensor]:
    """The MLP's output through the fused function, the layers' tensor-parallel communication around it
    (fc1's input gather, fc2's reduction and bias); None where it does not apply (the caller runs the
    layers one after the other)."""
    copies = _copies(fc1, fc2, hidden, config)
    if copies is None:
        return None
    x = fc1.parallel_input(hidden)
    (copy1, copy2), dtype = copies, torch.get_autocast_dtype(x.device.type)
    (scales1, amax_leaf1), (scales2, amax_leaf2) = delayed_arguments(copy1.delayed), delayed_arguments(copy2.delayed)
    output, x_amax, a_amax = _Float8SwiGLUMLP.apply(
        x, fc1.weight, fc2.weight, *copy1[:3], *copy2[:3], dtype, copy1.gradient_dtype,
        fused_swiglu.configured(config), scales1, scales2, amax_leaf1, amax_leaf2,
        fc1.grad_into(), fc2.grad_into())
    for copy, amax in ((copy1, x_amax), (copy2, a_amax)):
        if copy.delayed is not None:
            raise_amax(copy.delayed.amax[0], amax)
    return fc2.parallel_output(output)
