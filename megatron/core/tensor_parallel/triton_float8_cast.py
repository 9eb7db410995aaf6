"""Delayed scaling's float8 cast in one pass: a Triton kernel (`--fp8-recipe delayed`).

Under delayed scaling (float8_scaling.py) a float8 layer's cast needs no amax before it: the scale is
given. So one read of each tile can do the whole cast: scale it in fp32, saturate it at the dtype's
largest value, round it to float8 (to nearest, as torch's cast: `float8_matmul.scaled_cast`'s values, bit
for bit), write it row-major and, transposed through registers and shared memory, column-major (the
weight gradient's layout), and raise the layer's running amax by the tile's (an atomic max, with
`record`). Compiled as tensor math the same cast measured 0.296 ms for fc2's input [8192 x 14336] on
an H100 where one pass takes 0.158 (docs/performance.md): Inductor writes the transposed copy in a
pass of its own. (Under the tensorwise recipe the same kernel was no faster than the tensor math: there
the amax before the cast is the cost, so it runs only with a given scale.) Whether it pays in the step
is measured there; it stays only if it does.

`cast_both_layouts(x, scale, dtype, amax)` is a `torch.library.triton_op` that mutates `amax`, so
compiled layers trace it into their graph, backward included. Where it cannot run (no Triton; a CPU
tensor outside a test that allows the interpreter, see `triton_support`) callers cast as tensor math
(`available`).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from megatron.core.triton_support import HAS_TRITON, LazyOp, interpreting, runs_on

BLOCK_M, BLOCK_K, NUM_WARPS = 128, 128, 8
"""One program's tile of x and its warps (the tile that measured fastest at the 7b-shape's widths)."""
INTERPRETER_BLOCK = 32
"""The interpreter's tile side (small, so tests cover partial tiles)."""


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can cast `x`: a contiguous 2-D floating tensor on CUDA with Triton installed
    (or on CPU under the interpreter where a test allows it)."""
    return x.dim() == 2 and x.is_floating_point() and x.is_contiguous() and runs_on(x, in_compiled_layers=True)


@functools.cache
def _kernel(interpreting: bool):
    """The jitted kernel (once per interpreter setting: triton.jit reads it)."""
    del interpreting  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr, RECORD: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (m < M)[:, None] & (k < K)[None, :]
        offsets = m.to(tl.int64)[:, None] * K + k[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if RECORD:  # |x| >= 0, so the float maximum is the running amax's
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        x = x * tl.load(scale_ptr)
        values = tl.minimum(tl.maximum(x, -LARGEST), LARGEST).to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(rows_ptr + offsets, values, mask=mask)
        transposed = k.to(tl.int64)[:, None] * M + m[None, :]
        tl.store(columns_ptr + transposed, tl.trans(values), mask=tl.trans(mask))

    return cast


def _register():
    """The op (torch.library warns when it registers a triton_op without Triton: only where it is)."""
    from torch.library import triton_op, wrap_triton

    @triton_op("megadlms::float8_cast_both_layouts", mutates_args=("amax",))
    def cast_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                amax: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        (m, k), interpreter = x.shape, interpreting()
        rows, columns = x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype)
        block_m, block_k = (INTERPRETER_BLOCK,) * 2 if interpreter else (BLOCK_M, BLOCK_K)
        if x.numel():
            grid = (-(-m // block_m), -(-k // block_k))
            wrap_triton(_kernel(interpreter))[grid](
                x, scale, rows, columns, scale if amax is None else amax, m, k, LARGEST=torch.finfo(dtype).max,
                RECORD=amax is not None, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=NUM_WARPS)
        return rows, columns

    return cast_op


_op = LazyOp(_register)
"""The registered op (triton_support.LazyOp)."""


def register_for(tensor: torch.Tensor) -> None:
    """Registers the op now where float8 layers on `tensor`'s device will call it (CUDA with Triton), so
    that a compiled layer finds it registered rather than registering it mid-trace."""
    if HAS_TRITON and tensor.is_cuda:
        _op()


def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x * scale saturated into float8 `dtype` [M, K], the same values transposed [K, M], contiguous)
    for a 2-D `x` the kernel can read (`available`) and a 0-d fp32 `scale`; raises the 0-d fp32 `amax`,
    when given, to max |x|."""
    return _op()(x, scale, dtype, amax)
