"""SwiGLU, silu(gate) * up, as two hand-written Triton kernels: the forward and its backward.

`swiglu(x)` takes fc1's output `x [..., 2f]` (each row is [gate; up], the layout of
`MLP.linear_fc1`) and returns `silu(gate) * up [..., f]`; its backward returns the gradient
of `x` in the same layout. Both compute in fp32 and round once to `x`'s dtype.

Why: under torch.compile the layer's SwiGLU backward is Inductor's fused kernel, which at
Qwen3-1.7B's shape took 6.8 ms of a 203 ms step; its floor (read gate, up and the incoming
gradient once, write both gradients once: 5 x 100 MB per layer at 8,192 tokens x 6,144) is
about 3.5 ms over the 28 layers. These kernels make exactly those passes.

The ops are `torch.library.triton_op`s with autograd registered, so torch.compile traces
them into the layer's graph (no graph break) and eager code calls them as well. They are
registered on first use (registering imports Triton and part of Inductor, about 2 s of a CPU
process's start that never runs them), or when a CUDA model that will use them is built
(`register_for`, before torch.compile traces the layer), and the kernels are built on first use, so
the package imports without Triton; `available(x)` says whether the kernels can run on `x`
(CUDA with Triton installed). The MLP uses them when `TransformerConfig.bias_swiglu_fusion`
is on (Megatron's default; `--no-bias-swiglu-fusion` turns it off) and runs the plain tensor
math everywhere else. Tests run them on CPU under Triton's interpreter (`triton_support.interpreter_allowed`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.library import triton_op, wrap_triton

from megatron.core.fusions.triton_support import HAS_TRITON, LazyOp, interpreting, runs_on

BLOCK = 4096
"""Columns of one row per program."""
NUM_WARPS = 8


def available(x: torch.Tensor) -> bool:
    """True where the kernels can run on `x`: a floating tensor on CUDA with Triton installed (or on
    CPU under the interpreter, where a test allows it: `triton_support.interpreter_allowed`)."""
    return x.is_floating_point() and runs_on(x, in_compiled_layers=True)


@functools.cache
def _kernels(interpreting: bool):
    """The two jitted kernels, built on first use (once per interpreter setting: triton.jit reads it)."""
    del interpreting  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def forward(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def backward(grad_ptr, x_ptr, dx_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        grad = tl.load(grad_ptr + row * width + cols, mask=mask).to(tl.float32)
        gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        d_up = grad * gate * sigmoid
        d_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
        tl.store(dx_ptr + row * 2 * width + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + row * 2 * width + width + cols, d_up.to(dx_ptr.dtype.element_ty), mask=mask)

    return forward, backward


def _grid(x: torch.Tensor, width: int, block: int):
    return (x.numel() // (2 * width), -(-width // block))


def _register():
    """The two ops and the forward's autograd. torch.library warns when it registers a triton_op without
    Triton, so this runs only where Triton is installed."""

    @triton_op("megadlms::swiglu", mutates_args=())
    def swiglu_op(x: torch.Tensor, block: int, num_warps: int) -> torch.Tensor:
        width = x.shape[-1] // 2
        out = x.new_empty(x.shape[:-1] + (width,))
        if out.numel():
            kernel = _kernels(interpreting())[0]
            wrap_triton(kernel)[_grid(x, width, block)](x, out, width, BLOCK=block, num_warps=num_warps)
        return out

    @triton_op("megadlms::swiglu_backward", mutates_args=())
    def swiglu_backward_op(grad: torch.Tensor, x: torch.Tensor, block: int, num_warps: int) -> torch.Tensor:
        width = x.shape[-1] // 2
        dx = torch.empty_like(x)
        if dx.numel():
            kernel = _kernels(interpreting())[1]
            wrap_triton(kernel)[_grid(x, width, block)](grad, x, dx, width, BLOCK=block, num_warps=num_warps)
        return dx

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.launch = inputs[1:]  # the forward's block and warps serve its backward

    def backward(ctx, grad):
        return swiglu_backward_op(grad.contiguous(), ctx.saved_tensors[0], *ctx.launch), None, None

    swiglu_op.register_autograd(backward, setup_context=setup_context)
    return swiglu_op, swiglu_backward_op


_ops = LazyOp(_register)
"""The registered ops, forward and backward (triton_support.LazyOp)."""


def configured(config) -> bool:
    """Whether a layer built with `config` runs SwiGLU through these kernels where they are `available`."""
    return config.gated_linear_unit and config.activation == "silu" and config.bias_swiglu_fusion


def register_for(config) -> None:
    """Registers the ops now where a model built with `config` will call them (CUDA, Triton, the
    fused SwiGLU on), so a compiled layer finds them registered rather than registering mid-trace."""
    if HAS_TRITON and torch.cuda.is_available() and configured(config):
        _ops()


def swiglu(x: torch.Tensor, block: Optional[int] = None, num_warps: Optional[int] = None) -> torch.Tensor:
    """silu(gate) * up for `x [..., 2f]` = [gate; up], through the Triton kernels (see `available`).
    `block` and `num_warps`: both kernels' launch configuration (default BLOCK and NUM_WARPS;
    tools/benchmark/step_parts.py times others)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension ([gate; up]), got {tuple(x.shape)}")
    if not HAS_TRITON:
        raise RuntimeError("SwiGLU's Triton kernels need Triton (pip install triton); check available(x) first")
    return _ops()[0](x.contiguous(), block or BLOCK, num_warps or NUM_WARPS)


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor, block: Optional[int] = None,
                    num_warps: Optional[int] = None) -> torch.Tensor:
    """`swiglu`'s input gradient for its output's gradient `grad [..., f]`, through the backward kernel."""
    return _ops()[1](grad.contiguous(), x.contiguous(), block or BLOCK, num_warps or NUM_WARPS)


def reference(x: torch.Tensor) -> torch.Tensor:
    """The same function as plain tensor math (what the MLP runs where the kernels do not)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`reference`'s gradient of `x` as autograd computes it (the same ops and roundings), for code
    that runs SwiGLU's backward itself (fp8/float8_mlp.py)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * torch.nn.functional.silu(gate)], dim=-1)
