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

Across the micro-batches of a step (Megatron's accumulation into `main_grad`): a `GemmLayer` whose
model's `GradSwitch` is on and whose fp32 weight's `.grad` already holds earlier micro-batches' sum gets this
micro-batch's gradient added by the GEMM itself (`out += a @ b`, cuBLAS's beta = 1), and autograd gets
no gradient for it (fp32 training too). Autograd would otherwise write a fresh fp32 gradient and add it
to `.grad` in a pass of its own: 16 bytes a parameter moved instead of 8. The schedules switch it on for
the model they run, micro-batch by micro-batch (`accumulating_into_grad(model, enabled)`, from
`data_parallel.no_sync` and the pipeline schedule's forwards), wherever no autograd hook has to see the
gradient: one process, pipeline stages, DDP's no-sync micro-batches; never under FSDP2. The float8
GEMMs (fp8/float8_copy.py, float8_mlp.py) add theirs the same way, through cuBLASLt's float8 GEMM with
beta = 1 (cublaslt.py).

A layer's GEMM is a `LinearGemm` it builds at construction (this module's `linear`); the precision
converter (megatron/core/precision/apply.py) replaces it with one that reads a working copy of the
weight (bf16, or float8), so the layers never know which.

On other devices (no `out_dtype` GEMM) the gradient is computed in the compute dtype and cast,
exactly as autocast does, so CPU runs and tests see the same numbers either way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn



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


def grad_to_add_into(weight: torch.Tensor, in_place: bool) -> Optional[torch.Tensor]:
    """`weight`'s fp32 `.grad` where its layer's GEMM adds the micro-batch's gradient into it (`in_place`,
    its model's `GradSwitch`, and a contiguous fp32 gradient of the weight's shape), else None."""
    if not in_place:
        return None
    grad = weight.grad
    if grad is None or not weight.requires_grad:
        return None
    if grad.dtype != torch.float32 or grad.shape != weight.shape or not grad.is_contiguous():
        return None
    return grad


class GradSwitch:
    """Whether the layers holding it add their weight gradients into `.grad` in place (see the module):
    one per model, flipped for each micro-batch by `accumulating_into_grad`."""

    __slots__ = ("in_place",)

    def __init__(self) -> None:
        self.in_place = False


class GemmLayer(nn.Module):
    """A layer whose `weight` a GEMM reads: the tensor-parallel linear layers, and the word embedding
    (read by the tied output layer's loss). It holds `gemm`, the `LinearGemm` it multiplies with (built
    at construction, replaced by the precision converter), and `grad_switch`, its model's `GradSwitch`
    (its own until `accumulating_into_grad` first runs on the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_switch = GradSwitch()

    def grad_into(self) -> Optional[torch.Tensor]:
        """The `.grad` this micro-batch's GEMM adds the weight's gradient into, or None (autograd's)."""
        return grad_to_add_into(self.weight, self.grad_switch.in_place)


def _switch_of(model: nn.Module) -> GradSwitch:
    """`model`'s switch, given to each of its layers the first time (then one flip a micro-batch, not a walk
    over the modules)."""
    switch = model.__dict__.get("grad_switch")
    if switch is None:
        switch = GradSwitch()
        for module in model.modules():
            if isinstance(module, GemmLayer):
                module.grad_switch = switch
        model.grad_switch = switch
    return switch


@contextmanager
def accumulating_into_grad(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within it (forward and backward of a micro-batch), `model`'s layers add their weight gradients into
    `.grad` in place where one exists (`enabled`), or leave them to autograd; restored on leaving. Only
    where nothing needs autograd's gradient hooks (see the module)."""
    switch = _switch_of(model)
    previous, switch.in_place = switch.in_place, enabled
    try:
        yield
    finally:
        switch.in_place = previous


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
           fp32_weight_grad: bool = True, weight_low: Optional[torch.Tensor] = None,
           grad_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear`, except that under autocast an fp32 weight's gradient comes out of its GEMM in fp32 (with
    `fp32_weight_grad`), and that with it the gradient is added into `grad_into` (the weight's existing
    `.grad`, `GemmLayer.grad_into`), in fp32 training too; otherwise plain `F.linear`. `weight_low`: a
    fresh copy of `weight` (precision/working_copy.py), read instead of casting when its dtype is autocast's."""
    device = x.device.type
    if fp32_weight_grad and weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype != torch.float32:
            low = weight_low if weight_low is not None and weight_low.dtype == dtype else None
            return _LinearFp32WeightGrad.apply(x, weight, bias, dtype, low, grad_into)
    if fp32_weight_grad and x.dtype == weight.dtype == torch.float32 and grad_into is not None:
        # fp32 arithmetic: only the in-place sum differs from F.linear
        return _LinearFp32WeightGrad.apply(x, weight, bias, torch.float32, None, grad_into)
    return nn.functional.linear(x, weight, bias)


class LinearGemm(nn.Module):
    """A layer's GEMM as it is built: `linear` (the fp32 weight gradient with `fp32_weight_grad`, Megatron's
    --gradient-accumulation-fusion). The precision converter swaps it for one reading a working copy of
    the weight (precision/working_copy.py, fp8/float8_copy.py); a module, so that the copies it holds
    move with the layer."""

    def __init__(self, fp32_weight_grad: bool = True) -> None:
        super().__init__()
        self.fp32_weight_grad = fp32_weight_grad

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                grad_into: Optional[torch.Tensor]) -> torch.Tensor:
        return linear(x, weight, bias, self.fp32_weight_grad, None, grad_into)

    def working_copy(self) -> Optional[torch.Tensor]:
        """The weight's copy in the compute dtype that a training forward reads instead of casting
        (the chunked loss's, for the output layer's weight), or None."""
        return None

    def extra_repr(self) -> str:
        return f"fp32_weight_grad={self.fp32_weight_grad}"
