"""A linear layer whose weight gradient leaves its GEMM in fp32 (Megatron's gradient-accumulation
fusion, without a separate main-grad buffer).

Under bf16/fp16 autocast with fp32 parameters, `F.linear` casts the weight to the compute dtype,
its backward GEMM writes the weight gradient in that dtype, and the cast's backward then converts
it to fp32 for `.grad`: one more read and write of every weight gradient per micro-batch (5.4 ms
a step at Qwen3-1.7B on an H200 when timed alone, `tools/benchmark/step_parts.py`). Here the
weight-gradient GEMM writes fp32 itself (cuBLAS's fp32 output from bf16 inputs, `out_dtype`),
which also keeps the bits the bf16 rounding dropped. Forward values and the input gradient are
autocast's. Measured in the compiled step: -1.2 ms at 1.7B, +0.15% at the 7B width
(docs/performance_history.md), because the compiler had already folded part of the cast away.

Across the micro-batches of a step (Megatron's accumulation into `main_grad`): inside
`accumulating_into_grad()` a weight whose fp32 `.grad` already holds earlier micro-batches' sum gets
this micro-batch's gradient added by the GEMM itself (`out += a @ b`, cuBLAS's beta = 1), and autograd
gets no gradient for it (fp32 training too). Autograd would otherwise write a fresh fp32 gradient and
add it to `.grad` in a pass of its own: 16 bytes a parameter moved instead of 8. The schedules enable
it wherever no autograd hook has to see the gradient (`data_parallel.no_sync`, the pipeline schedule's
forwards): one process, pipeline stages, DDP's no-sync micro-batches; never under FSDP2.
The float8 layers (float8_matmul.float8_linear, float8_mlp.py) add theirs the same way, through
cuBLASLt's float8 GEMM with beta = 1 (cublaslt.py).

On other devices (no `out_dtype` GEMM) the gradient is computed in the compute dtype and cast,
exactly as autocast does, so CPU runs and tests see the same numbers either way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from megatron.core.fp8.float8_matmul import float8_linear, float8_ready
from megatron.core.precision.working_copy import Float8Copy


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from compute-dtype operands: written by the GEMM on CUDA, cast elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (fp32) = a @ b, or += with `accumulate`; a and b in the compute dtype. On CUDA the GEMM
    writes or accumulates the fp32 result itself (out_dtype): no low-precision product and no separate
    add pass over `out`."""
    if out.is_cuda and a.dtype != out.dtype:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out += a @ b
    else:
        out.copy_(a @ b)


@torch.library.custom_op("megadlms::accumulate_matmul_", mutates_args=("out",))
def accumulate_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place (`matmul_into`): an op of its own, so a compiled backward adds into the
    gradient itself rather than into a copy it then writes back."""
    matmul_into(out, a, b, accumulate=True)


_in_place = False
"""Whether linear layers add their weight gradients into an existing fp32 `.grad` (see the module)."""


@contextmanager
def accumulating_into_grad(enabled: bool = True) -> Iterator[None]:
    """Within it (forward and backward of a micro-batch), weight gradients are added into `.grad` in
    place where one exists; only where nothing needs autograd's gradient hooks (see the module)."""
    global _in_place
    previous, _in_place = _in_place, enabled
    try:
        yield
    finally:
        _in_place = previous


def grad_to_add_into(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight`'s fp32 `.grad` where its layer's GEMM adds the micro-batch's gradient into it (inside
    `accumulating_into_grad()`, a contiguous fp32 gradient of the weight's shape), else None."""
    grad = weight.grad
    if not _in_place or grad is None or not weight.requires_grad:
        return None
    if grad.dtype != torch.float32 or grad.shape != weight.shape or not grad.is_contiguous():
        return None
    return grad


class _LinearFp32WeightGrad(torch.autograd.Function):
    """`x W^T + b` in `dtype`; the gradients of the fp32 W and b are produced in fp32 (W's added into
    `grad_into`, its existing `.grad`, when one is given)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                dtype: torch.dtype, weight_low: Optional[torch.Tensor] = None,
                grad_into: Optional[torch.Tensor] = None) -> torch.Tensor:
        # weight_low: the layer's working copy of `weight` in `dtype` (weight_copies.py), else a cast
        x_low, weight_low = x.to(dtype), weight.to(dtype) if weight_low is None else weight_low
        ctx.save_for_backward(x_low, weight_low)
        ctx.grad_into = grad_into
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
        grad_weight = None
        if needs_weight and ctx.grad_into is not None:
            accumulate_matmul_(ctx.grad_into, rows.t(), x_low.reshape(-1, x_low.shape[-1]))
        elif needs_weight:
            grad_weight = matmul_fp32(rows.t(), x_low.reshape(-1, x_low.shape[-1]))
        grad_bias = rows.sum(0, dtype=torch.float32) if ctx.has_bias and needs_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fp32_weight_grad: bool = True, weight_low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear`, except that under autocast an fp32 weight's gradient comes out of its GEMM in
    fp32 (with `fp32_weight_grad`), and that with it the gradient is added into an existing `.grad`
    within `accumulating_into_grad()`, in fp32 training too; otherwise plain `F.linear`. `weight_low`:
    a fresh copy of `weight` (weight_copies.py), read instead of casting when its dtype is autocast's;
    a float8 copy runs the GEMMs in float8 (when `x`'s rows allow it)."""
    device = x.device.type
    if fp32_weight_grad and weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if isinstance(weight_low, Float8Copy):
            if float8_ready(x):
                return float8_linear(x, weight, bias, weight_low, dtype, grad_to_add_into(weight))
            weight_low = None
        if dtype != torch.float32:
            low = weight_low if weight_low is not None and weight_low.dtype == dtype else None
            return _LinearFp32WeightGrad.apply(x, weight, bias, dtype, low, grad_to_add_into(weight))
    fp32 = fp32_weight_grad and x.dtype == weight.dtype == torch.float32
    grad_into = grad_to_add_into(weight) if fp32 else None
    if grad_into is not None:  # fp32 arithmetic: only the in-place sum differs from F.linear
        return _LinearFp32WeightGrad.apply(x, weight, bias, torch.float32, None, grad_into)
    return nn.functional.linear(x, weight, bias)
