"""The float8 layers' scaled cast into both layouts in one pass: a Triton kernel.

Each float8 linear (`float8_matmul.float8_linear`) casts its input in the forward and its output
gradient in the backward, and needs each in two layouts: row-major for one GEMM, transposed for the
weight gradient's. Compiled as tensor math, the cast and the transposed copy are Inductor's kernels:
a pass that casts and a transpose of one-byte elements. Measured at the `7b-shape` (docs/performance.md,
`step_parts.py --float8-cast-tokens`), fc2's input [8192 x 14336] took 0.62 ms where one pass (read 2
bytes an element, write 1 twice) takes 0.11; most of it turned out to be the amax (0.44 ms, since read
rows first: `float8_matmul._scale`). This kernel alone took 0.127 ms (3.7 TB/s); whether it beats
Inductor's cast and transpose in a training step is measured there, and it stays only if it does.

`cast_both_layouts(x, scale, dtype)` reads a [M, K] tile of `x` once, scales it in fp32, saturates it
at the dtype's largest value, rounds it to float8 (to nearest, as torch's cast does: the values are
those of `float8_matmul.scaled_cast`, bit for bit) and writes the tile twice: into the [M, K] result and,
transposed in registers and shared memory, into the [K, M] one, both as whole rows of bytes. The amax
that gives the scale stays a reduction of the caller's (Inductor's, fused with whatever produced `x`
where it can be). It is a `torch.library.triton_op`, so compiled layers trace it into their graph.
Where it cannot run (no Triton; a CPU tensor outside a test that allows the interpreter, see
`triton_support`) callers cast as tensor math (`available`).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from megatron.core.triton_support import HAS_TRITON, LazyOp, interpreting, runs_on

BLOCK_M, BLOCK_K, NUM_WARPS = 128, 128, 8
"""One program's tile of x and its warps (`step_parts.py --float8-cast-tokens` times the others)."""
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
    def cast(x_ptr, scale_ptr, rows_ptr, columns_ptr, M, K, LARGEST: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (m < M)[:, None] & (k < K)[None, :]
        offsets = m.to(tl.int64)[:, None] * K + k[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        values = tl.minimum(tl.maximum(x, -LARGEST), LARGEST).to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(rows_ptr + offsets, values, mask=mask)
        transposed = k.to(tl.int64)[:, None] * M + m[None, :]
        tl.store(columns_ptr + transposed, tl.trans(values), mask=tl.trans(mask))

    return cast


def _register():
    """The op (torch.library warns when it registers a triton_op without Triton: only where it is)."""
    from torch.library import triton_op, wrap_triton

    @triton_op("megadlms::float8_cast_both_layouts", mutates_args=())
    def cast_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        (m, k), interpreter = x.shape, interpreting()
        rows, columns = x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype)
        block_m, block_k = (INTERPRETER_BLOCK,) * 2 if interpreter else (BLOCK_M, BLOCK_K)
        if x.numel():
            grid = (-(-m // block_m), -(-k // block_k))
            wrap_triton(_kernel(interpreter))[grid](x, scale, rows, columns, m, k, LARGEST=torch.finfo(dtype).max,
                                                    BLOCK_M=block_m, BLOCK_K=block_k, num_warps=NUM_WARPS)
        return rows, columns

    return cast_op


_op = LazyOp(_register)
"""The registered op (triton_support.LazyOp)."""


def register_for(tensor: torch.Tensor) -> None:
    """Registers the op now where float8 layers on `tensor`'s device will call it (CUDA with Triton), so
    that a compiled layer finds it registered rather than registering it mid-trace."""
    if HAS_TRITON and tensor.is_cuda:
        _op()


def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x * scale saturated into float8 `dtype` [M, K], the same values transposed [K, M], contiguous)
    for a 2-D `x` the kernel can read (`available`) and a 0-d fp32 `scale`."""
    return _op()(x, scale, dtype)
