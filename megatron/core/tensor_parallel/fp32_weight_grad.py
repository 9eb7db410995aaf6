"""A linear layer whose weight gradient leaves its GEMM in fp32 (Megatron's gradient-accumulation
fusion, without a separate main-grad buffer).

Under bf16/fp16 autocast with fp32 parameters, `F.linear` casts the weight to the compute dtype,
its backward GEMM writes the weight gradient in that dtype, and the cast's backward then converts
it to fp32 for `.grad`: one more read and write of every weight gradient per micro-batch (5.4 ms
a step at Qwen3-1.7B on an H200 when timed alone, `tools/benchmark/step_parts.py`). Here the
weight-gradient GEMM writes fp32 itself (cuBLAS's fp32 output from bf16 inputs, `out_dtype`),
which also keeps the bits the bf16 rounding dropped. Forward values and the input gradient are
autocast's. Measured in the compiled step: -1.2 ms at 1.7B, +0.15% at the 7B width
(docs/performance.md), because the compiler had already folded part of the cast away.

On other devices (no `out_dtype` GEMM) the gradient is computed in the compute dtype and cast,
exactly as autocast does, so CPU runs and tests see the same numbers either way.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.core.tensor_parallel.float8_matmul import float8_linear, float8_ready
from megatron.core.tensor_parallel.weight_copies import Float8Copy


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from compute-dtype operands: written by the GEMM on CUDA, cast elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


class _LinearFp32WeightGrad(torch.autograd.Function):
    """`x W^T + b` in `dtype`; the gradients of the fp32 W and b are produced in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                dtype: torch.dtype, weight_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        # weight_low: the layer's working copy of `weight` in `dtype` (weight_copies.py), else a cast
        x_low, weight_low = x.to(dtype), weight.to(dtype) if weight_low is None else weight_low
        ctx.save_for_backward(x_low, weight_low)
        ctx.has_bias = bias is not None
        with torch.autocast(x.device.type, enabled=False):  # the dtypes here are chosen explicitly
            return nn.functional.linear(x_low, weight_low, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_low, weight_low = ctx.saved_tensors
        grad_output = grad_output.to(weight_low.dtype)
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        # autograd casts grad_input to x's dtype, as autocast's cast does
        grad_input = grad_output @ weight_low if needs_input else None
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = matmul_fp32(rows.t(), x_low.reshape(-1, x_low.shape[-1])) if needs_weight else None
        grad_bias = rows.sum(0, dtype=torch.float32) if ctx.has_bias and needs_bias else None
        return grad_input, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fp32_weight_grad: bool = True, weight_low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear`, except that under autocast an fp32 weight's gradient comes out of its GEMM in
    fp32 (with `fp32_weight_grad`); outside autocast, or for low-precision weights, plain `F.linear`.
    `weight_low`: a fresh copy of `weight` (weight_copies.py), read instead of casting when its
    dtype is autocast's; a float8 copy runs the GEMMs in float8 (when `x`'s rows allow it)."""
    device = x.device.type
    if fp32_weight_grad and weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if isinstance(weight_low, Float8Copy):
            if float8_ready(x):
                return float8_linear(x, weight, bias, weight_low, dtype)
            weight_low = None
        if dtype != torch.float32:
            low = weight_low if weight_low is not None and weight_low.dtype == dtype else None
            return _LinearFp32WeightGrad.apply(x, weight, bias, dtype, low)
    return nn.functional.linear(x, weight, bias)
