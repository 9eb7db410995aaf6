"""RMSNorm as two hand-written Triton kernels: the forward, and a backward that makes the input's and
the weight's gradients in one pass over the input and the incoming gradient.

`rms_norm(x, scale, eps)` normalises each row of `x [..., h]` in fp32 (x * rsqrt(mean(x^2) + eps)),
multiplies by the fp32 `scale [h]` (RMSNorm's weight, or 1 + weight when zero-centred) and rounds once
to `x`'s dtype, as `norms.RMSNorm` does in tensor math; its backward returns the gradient of `x` in
`x`'s dtype and that of `scale` in fp32.

Why: under torch.compile a norm's backward is Inductor's kernels, which make the input gradient (a
reduction along each row) and the weight gradient (a reduction over all rows) in separate kernels,
each reading the input and the incoming gradient; the profiles put the weight-gradient reductions at
4.6 ms of a 203 ms step at Qwen3-1.7B (four norms a layer with the query and key norms, 28 layers).
Here each program of the backward walks a band of rows once: it writes their input gradients and
keeps the band's weight-gradient sum in registers, and the bands' partial sums (a few MB) are added
at the end. Whether that beats Inductor in a compiled layer, where its norm kernels also take in the
residual add and RoPE, was measured (`tools/benchmark/step_parts.py --rmsnorm-tokens`, then the step):
alone no faster than Inductor's norm, and 3.1 ms slower in the compiled 1.7B step, where the op ends
those fusions (docs/performance.md). So the layers use it only with `TransformerConfig.rmsnorm_fusion`
(off by default).

The ops are `torch.library.triton_op`s with autograd registered, as SwiGLU's (fused_swiglu.py):
torch.compile traces them into the layer's graph and eager code calls them; they are registered on
first use and the kernels built then, so the package imports without Triton. Where they can run is
SwiGLU's `available(x)` (CUDA with Triton; CPU under the interpreter where a test allows it).
"""

from __future__ import annotations

import functools

import torch
from torch.library import triton_op, wrap_triton

from megatron.core.fusions.triton_support import HAS_TRITON, LazyOp, interpreting, runs_on

TILE = 4096
"""Elements of one tile of rows (rows x the row width rounded up to a power of two)."""
PROGRAMS = 512
"""Programs of the backward, each a band of rows: more parallelism, against more partial sums."""


def available(x: torch.Tensor) -> bool:
    """True where the kernels can run on `x` (as SwiGLU's: CUDA, or the interpreter where a test allows it)."""
    return x.is_floating_point() and runs_on(x, in_compiled_layers=True)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels(interpreting: bool):
    """The jitted forward and backward, built on first use (once per interpreter setting)."""
    del interpreting  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def forward(x_ptr, scale_ptr, y_ptr, rstd_ptr, rows, width, eps, ROWS: tl.constexpr, COLS: tl.constexpr):
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, COLS)
        inside = (row[:, None] < rows) & (cols[None, :] < width)
        offsets = row[:, None] * width + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
        scale = tl.load(scale_ptr + cols, mask=cols < width, other=0.0)
        y = x * rstd[:, None] * scale[None, :]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + row, rstd, mask=row < rows)

    @triton.jit
    def backward(grad_ptr, x_ptr, scale_ptr, rstd_ptr, dx_ptr, partial_ptr, rows, width, tiles_per_program,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, COLS)
        scale = tl.load(scale_ptr + cols, mask=cols < width, other=0.0)
        dscale = tl.zeros((COLS,), dtype=tl.float32)
        for tile in range(0, tiles_per_program):
            row = ((program * tiles_per_program + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            inside = (row[:, None] < rows) & (cols[None, :] < width)
            offsets = row[:, None] * width + cols[None, :]
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
            normed = x * rstd[:, None]
            dnormed = grad * scale[None, :]
            mean = tl.sum(dnormed * normed, axis=1) / width
            dx = rstd[:, None] * (dnormed - normed * mean[:, None])
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)
            dscale += tl.sum(grad * normed, axis=0)
        tl.store(partial_ptr + program * width + cols, dscale, mask=cols < width)

    return forward, backward


def _tiling(x: torch.Tensor):
    """(rows, width, rows of a tile, the width rounded up to a power of two)."""
    width = x.shape[-1]
    cols = _next_power_of_2(width)
    return x.numel() // max(width, 1), width, max(1, TILE // cols), cols


def _register():
    """The forward and backward ops and the forward's autograd (only where Triton is installed)."""

    @triton_op("megadlms::rms_norm", mutates_args=())
    def rms_norm_op(x: torch.Tensor, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width, tile_rows, cols = _tiling(x)
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        if rows:
            grid = (-(-rows // tile_rows),)
            wrap_triton(_kernels(interpreting())[0])[grid](x, scale, y, rstd, rows, width, eps,
                                                            ROWS=tile_rows, COLS=cols)
        return y, rstd

    @triton_op("megadlms::rms_norm_backward", mutates_args=())
    def rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width, tile_rows, cols = _tiling(x)
        tiles = -(-rows // tile_rows)
        tiles_per_program = max(1, -(-tiles // PROGRAMS))
        programs = -(-tiles // tiles_per_program)
        dx = torch.empty_like(x)
        partial = torch.zeros((max(programs, 1), width), dtype=torch.float32, device=x.device)
        if rows:
            wrap_triton(_kernels(interpreting())[1])[(programs,)](
                grad, x, scale, rstd, dx, partial, rows, width, tiles_per_program, ROWS=tile_rows, COLS=cols)
        return dx, partial

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])

    def backward(ctx, grad, _grad_rstd):
        x, scale, rstd = ctx.saved_tensors
        dx, partial = rms_norm_backward_op(grad.contiguous(), x, scale, rstd)
        return dx, partial.sum(0), None

    rms_norm_op.register_autograd(backward, setup_context=setup_context)
    return rms_norm_op


_op = LazyOp(_register)
"""The registered op (triton_support.LazyOp)."""


def register_for(config) -> None:
    """Registers the ops now where a model built with `config` will call them (CUDA, Triton, the fusion
    on), so a compiled layer finds them registered rather than registering mid-trace."""
    if HAS_TRITON and torch.cuda.is_available() and config.rmsnorm_fusion and config.normalization == "RMSNorm":
        _op()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of `x` times the fp32 `scale`, in `x`'s dtype, through the kernels (see `available`)."""
    if scale.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: a scale of shape {tuple(scale.shape)} for rows of width {x.shape[-1]}")
    if not HAS_TRITON:
        raise RuntimeError("RMSNorm's Triton kernels need Triton (pip install triton); check available(x) first")
    return _op()(x.contiguous(), scale.float().contiguous(), float(eps))[0]
