"""Float8 GEMMs of the decoder's linear layers: tensorwise-scaled e4m3 / e5m2 operands through
`torch._scaled_mm`, reading float8 working copies of the weights (float8_copy.py), which
`--fp8-format` turns on.

Scaling is tensorwise: each operand is multiplied by max(dtype) / amax before the cast (saturating),
and the GEMM multiplies the product back by both inverses; the amax is the operand's own (current
scaling), or with `--fp8-recipe delayed` the scale comes from earlier iterations' amaxes
(float8_scaling.py). Forward operands are e4m3; the output gradient is e5m2 under the hybrid format
(Megatron's meaning), e4m3 under e4m3. cuBLAS wants the first operand row-major, the second
column-major and every dimension a multiple of 16.

`float8_linear` reads its weight's float8 copies (float8_copy.py, cast once an iteration) instead of casting the fp32
weight every forward. All three GEMMs run in float8: the output (e4m3 x e4m3, fast accumulation), the
input gradient (the output gradient x the weight's transposed copy) and the weight gradient (the output
gradient x the input, both transposed in the cast that makes them; fp32 out, so the fp32 weight's
gradient leaves its GEMM in fp32). The forward saves the input's float8 transposed copy for the weight
gradient (1 byte an element instead of the compute dtype's 2, and no second cast in the backward). A
cast by the tensor's own amax is tensor math that the compiled layer fuses (a Triton kernel was no
faster there: the amax before the cast is the cost); a cast by a given scale (delayed scaling) is one
Triton kernel that writes both layouts and takes the amax (fused_float8_cast.py), where compiled tensor
math took two passes. As the bf16 layers' (fp32_weight_grad.py), the weight gradient of a micro-batch
after a step's first is added into `.grad` by its GEMM where the schedule allows it (`grad_into`):
`_scaled_mm` has no beta, so that GEMM is cuBLASLt's own, called with beta = 1 (cublaslt.py). A SwiGLU
MLP of two such layers runs as one function (float8_mlp.py: the same GEMMs, `forward_gemm` and
`backward_gemms`, with SwiGLU fused into the casts). On a CPU the GEMMs run eagerly through torch's own
kernel (`float8_gemms_on_cpu`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from megatron.core.fusions import fused_float8_cast
from megatron.core.fusions.cublaslt import scaled_mm_add_

FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPES = {"hybrid": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
ALIGNMENT = 16


def scaled_cast(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor * scale in `dtype`, saturating at its largest value."""
    largest = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-largest, largest).to(dtype)


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps `amax` onto `dtype`'s largest value (fp32, 0-d). Divided in fp64: compiled
    code turns the division into a reciprocal and a product, which in fp32 rounds differently."""
    return (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()


def tensor_amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| in fp32 (0-d), the rows' maxima first (see `amax_scale`)."""
    magnitude = tensor.detach().abs()
    return (magnitude.amax(dim=-1).amax() if magnitude.dim() > 1 else magnitude.amax()).float()


def raise_amax(slot: torch.Tensor, amax: torch.Tensor) -> None:
    """Raise `slot` (delayed scaling's running amax) to `amax` (a cast's). The forward's is traced into the
    compiled layer; the backward's arrives through a hook (float8_scaling.DelayedScaling._gradient_amax_leaf)."""
    slot.copy_(torch.maximum(slot, amax.reshape(slot.shape)))


def amax_scale(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale of `tensor`'s amax. Rows first: compiled, one reduction over all of a [8192, 14336]
    tensor ran at 0.5 TB/s on an H200 (docs/performance_history.md); the rows' maxima, then theirs, are the same
    value."""
    return scale_of(tensor_amax(tensor), dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype):
    amax = tensor_amax(tensor)
    scale = scale_of(amax, dtype)
    return scaled_cast(tensor, scale, dtype), scale.reciprocal(), amax


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True)


def _eager_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and not torch.compiler.is_compiling()  # inside a compiled layer: traced


def float8_with_amax(tensor: torch.Tensor, dtype: torch.dtype):
    """(tensor in `dtype`, scaled so that its amax lands on the dtype's largest value; the inverse scale,
    a 0-d fp32 tensor the GEMM multiplies back; the amax, 0-d fp32)."""
    return (_compiled(_cast) if _eager_cuda(tensor) else _cast)(tensor, dtype)


def to_float8(tensor: torch.Tensor, dtype: torch.dtype):
    """`float8_with_amax`'s values and inverse scale."""
    return float8_with_amax(tensor, dtype)[:2]


def float8_gemms_on_cpu(device: torch.device) -> None:
    """Float8 GEMMs on a CPU (tests, the quickstart) through torch's own `_scaled_mm` kernel, which
    widens the operands and runs its ordinary GEMM: oneDNN's float8 matmul, which torch takes on CPUs
    with AMX tiles, is oneDNN's reference loop there (about 1 s for one [1024, 128] x [128, 384]
    product on a Sapphire Rapids core, 3 ms through torch's kernel, the same bits). This turns oneDNN
    off for the process, so call it only where float8 GEMMs run on the CPU."""
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        torch.backends.mkldnn.enabled = False


class DelayedScales(NamedTuple):
    """A float8 layer's delayed scaling (float8_scaling.py): its row of the scales and of the running
    amaxes ([2] each: the input, the output gradient), whether the scales are set yet, and the leaf
    whose gradient carries the output gradient's amax out of the backward (`gradient_amax`)."""

    scales: torch.Tensor
    amax: torch.Tensor
    ready: bool
    gradient_amax: torch.Tensor


def cast_both_layouts(tensor: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor]):
    """A float8 layer's cast of a 2-D tensor: (values [M, K], the values transposed [K, M] contiguous,
    inverse scale, amax), scaled by its own amax or by a given `scale` (delayed scaling: in one pass,
    where the Triton kernel runs, fused_float8_cast.py)."""
    if scale is None:
        values, inverse, amax = float8_with_amax(tensor, dtype)
        return values, values.t().contiguous(), inverse, amax
    if fused_float8_cast.available(tensor):
        rows, columns, amax = fused_float8_cast.cast_both_layouts(tensor, scale, dtype)
        return rows, columns, scale.reciprocal(), amax
    return scaled_cast_both_layouts(tensor, dtype, scale)


def scaled_cast_both_layouts(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor):
    """The cast by a given scale as tensor math (where the Triton kernel does not run): `cast_both_layouts`'
    four results, in two passes once compiled (the transposed copy is a pass of its own)."""
    values = scaled_cast(tensor, scale, dtype)
    return values, values.t().contiguous(), scale.reciprocal(), tensor_amax(tensor)


def forward_gemm(x8: torch.Tensor, x_inverse: torch.Tensor, rows: torch.Tensor, inverse_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """A float8 layer's output: the cast input [M, K] x the weight's row-major copy [N, K]^T, fast
    accumulation, as torchao's float8 forward."""
    return torch._scaled_mm(x8, rows.t(), scale_a=x_inverse, scale_b=inverse_scale, out_dtype=out_dtype,
                            use_fast_accum=True)


def backward_gemms(grad, weight, saved_input, out_dtype: torch.dtype, grad_into: Optional[torch.Tensor] = None):
    """A float8 layer's (input gradient in `out_dtype`, weight gradient in fp32) from the cast output
    gradient (values, values transposed, inverse scale), the weight's (columns copy, inverse scale) and the
    forward's saved (transposed input, inverse scale). With `grad_into` (the weight's fp32 `.grad`) the
    weight gradient is added into it by the GEMM and returned as None."""
    (grad8, grad8_t, grad_inverse), (columns, inverse_scale), (x8_t, x_inverse) = grad, weight, saved_input
    grad_input = torch._scaled_mm(grad8, columns.t(), scale_a=grad_inverse, scale_b=inverse_scale,
                                  out_dtype=out_dtype)
    if grad_into is not None:
        scaled_mm_add_(grad_into, grad8_t, x8_t, grad_inverse, x_inverse)
        return grad_input, None
    grad_weight = torch._scaled_mm(grad8_t, x8_t.t(), scale_a=grad_inverse, scale_b=x_inverse,
                                   out_dtype=torch.float32)
    return grad_input, grad_weight


GRADIENT_AMAX_INPUT = 9
"""`_Float8Linear.forward`'s argument index of `gradient_amax` (after ctx)."""


class _Float8Linear(torch.autograd.Function):
    """x W^T + b with all three GEMMs in float8, W read from its float8 copies (see the module docstring);
    with `scales` (delayed scaling) the input and the output gradient are cast by them. Returns the output
    and the input's amax (the caller records it); the output gradient's amax is the gradient of the leaf
    `gradient_amax` [1]. A gradient, not a write into the running amax: a compiled backward that writes
    into a tensor must save it, and torch before 2.13 then checks its version counter, which other
    layers' records (and other micro-batches' backwards, under pipeline schedules) have moved by then."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias, rows: torch.Tensor, columns: torch.Tensor,
                inverse_scale: torch.Tensor, out_dtype: torch.dtype, gradient_dtype: torch.dtype,
                scales: Optional[torch.Tensor], gradient_amax: Optional[torch.Tensor],
                grad_into: Optional[torch.Tensor] = None) -> torch.Tensor:
        del weight  # its gradient is what the backward returns (or adds into grad_into); values: the copies
        ctx.out_dtype, ctx.gradient_dtype, ctx.has_bias = out_dtype, gradient_dtype, bias is not None
        ctx.scales, ctx.grad_into = scales, grad_into  # scales change between iterations only
        with torch.autocast(x.device.type, enabled=False):  # every dtype here is explicit (compiled code
            flat = x.reshape(-1, x.shape[-1])               # would otherwise see autocast's casts in the casts)
            x8, x8_t, x_inverse, x_amax = cast_both_layouts(flat.to(out_dtype), FORWARD_DTYPE,
                                                             None if scales is None else scales[0])
            ctx.save_for_backward(x8_t, x_inverse, columns, inverse_scale)
            output = forward_gemm(x8, x_inverse, rows, inverse_scale, out_dtype)
            if bias is not None:
                output = output + bias.to(out_dtype)
        ctx.mark_non_differentiable(x_amax)
        return output.reshape(*x.shape[:-1], rows.shape[0]), x_amax

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_x_amax):
        del grad_x_amax  # not differentiable
        x8_t, x_inverse, columns, inverse_scale = ctx.saved_tensors
        scales = ctx.scales
        flat = grad_output.reshape(-1, grad_output.shape[-1]).to(ctx.out_dtype)
        grad8, grad8_t, grad_inverse, grad_amax = cast_both_layouts(flat, ctx.gradient_dtype,
                                                                     None if scales is None else scales[1])
        grad_input, grad_weight = backward_gemms((grad8, grad8_t, grad_inverse), (columns, inverse_scale),
                                                 (x8_t, x_inverse), ctx.out_dtype, ctx.grad_into)
        grad_bias = flat.sum(0, dtype=torch.float32) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_amax = grad_amax.reshape(1) if ctx.needs_input_grad[GRADIENT_AMAX_INPUT] else None
        return (grad_input.reshape(*grad_output.shape[:-1], columns.shape[0]), grad_weight, grad_bias,
                None, None, None, None, None, None, grad_amax, None)


def float8_ready(x: torch.Tensor) -> bool:
    """Whether `x`'s rows (every dim but the last) can be a float8 GEMM's dimension."""
    return x.numel() // x.shape[-1] % ALIGNMENT == 0


def delayed_arguments(delayed: Optional[DelayedScales]):
    """(the scales to cast by, None before they are ready; the output gradient's amax leaf) of a float8
    layer's delayed scaling, (None, None) without it."""
    if delayed is None:
        return None, None
    return (delayed.scales if delayed.ready else None), delayed.gradient_amax


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias, copy, out_dtype: torch.dtype,
                  grad_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x weight^T + bias` in float8 from the weight's float8 copy (`float8_copy.Float8Copy`) in
    `out_dtype`; the gradients of the fp32 weight and bias in fp32 (the weight's added into `grad_into`,
    its existing `.grad`, where one is given). `x`'s rows: a multiple of 16. With the copy's `delayed`
    scales, the input and output gradient are cast by them once they are `ready` (before, by their own
    amax), and both amaxes are recorded."""
    delayed: Optional[DelayedScales] = copy.delayed
    scales, gradient_amax = delayed_arguments(delayed)
    output, amax = _Float8Linear.apply(x, weight, bias, copy.rows, copy.columns, copy.inverse_scale, out_dtype,
                                       copy.gradient_dtype, scales, gradient_amax, grad_into)
    if delayed is not None:
        raise_amax(delayed.amax[0], amax)
    return output
