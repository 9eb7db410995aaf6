"""Delayed scaling's float8 cast in one pass: a Triton kernel (`--fp8-recipe delayed`).

Under delayed scaling (float8_scaling.py) a float8 layer's cast needs no amax before it: the scale is
given. So one read of each tile does the whole cast: scale it in fp32, saturate it at the dtype's largest
value, round it to float8 (to nearest, as torch's cast: `float8_matmul.scaled_cast`'s values, bit for
bit) and write it row-major; transpose the 16-bit tile in registers and shared memory and write its
float8 values again column-major (the weight gradient's layout); and take the tile's amax into the
tensor's (one atomic max a tile), which the layer records. Compiled as tensor math the same cast is two
passes (Inductor writes the transposed copy in a pass of its own): on an H100 fc2's input [8192 x 14336]
took 0.29 ms that way and 0.17 in this kernel, fc1's output gradient [8192 x 28672] 0.55 and 0.35
(docs/performance.md). Two earlier kernels that transposed the float8 tile instead, with one fixed tile
shape, were no faster than the tensor math; this one's tile shape is autotuned per width.

`cast_both_layouts(x, scale, dtype)` is a `torch.library.triton_op`, so compiled layers trace it into
their graph, backward included, and returns (values [M, K], values transposed [K, M], amax): fresh
tensors, nothing mutated. Where it cannot run (no Triton; a CPU tensor outside a test that allows the
interpreter, see `triton_support`) callers cast as tensor math (`available`).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from megatron.core.triton_support import LazyOp, interpreting, runs_on

CONFIGS = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8)]
"""(BLOCK_M, BLOCK_K, warps) the autotuner tries on a GPU (its key: the shape)."""
INTERPRETER_BLOCK = 16
"""The interpreter's tile side: small, so a test's shapes cover partial tiles."""


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can cast `x`: a contiguous 2-D floating tensor on CUDA with Triton installed
    (or on CPU under the interpreter where a test allows it)."""
    return x.dim() == 2 and x.is_floating_point() and x.is_contiguous() and runs_on(x, in_compiled_layers=True)


@functools.cache
def _kernel(interpreter: bool):
    """The jitted kernel; autotuned over CONFIGS on a GPU, one small tile under the interpreter."""
    import triton
    import triton.language as tl

    def cast_transpose(x_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (m < M)[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mask, other=0.0)
        scale = tl.load(scale_ptr)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))  # |x| >= 0
        rows = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -LARGEST), LARGEST)
        tl.store(rows_ptr + m.to(tl.int64)[:, None] * K + k[None, :],
                 rows.to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        x_t = tl.trans(x)  # the 16-bit tile, [BLOCK_K, BLOCK_M]: converted again rather than shuffling bytes
        columns = tl.minimum(tl.maximum(x_t.to(tl.float32) * scale, -LARGEST), LARGEST)
        tl.store(columns_ptr + k.to(tl.int64)[:, None] * M + m[None, :],
                 columns.to(columns_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))

    jitted = triton.jit(cast_transpose)
    if interpreter:
        return jitted
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps) for bm, bk, warps in CONFIGS]
    return triton.autotune(configs, key=["M", "K"])(jitted)  # the atomic max is idempotent: no restore


def _register():
    """The op (torch.library warns when it registers a triton_op without Triton: only where it is)."""
    from torch.library import triton_op, wrap_triton

    @triton_op("megadlms::float8_cast_both_layouts", mutates_args=())
    def cast_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (m, k), interpreter = x.shape, interpreting()
        rows, columns = x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype)
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        if x.numel():
            kernel, largest = wrap_triton(_kernel(interpreter)), torch.finfo(dtype).max
            if interpreter:
                grid = (-(-m // INTERPRETER_BLOCK), -(-k // INTERPRETER_BLOCK))
                kernel[grid](x, scale, rows, columns, amax, m, k, LARGEST=largest, BLOCK_M=INTERPRETER_BLOCK,
                             BLOCK_K=INTERPRETER_BLOCK)
            else:
                kernel[lambda meta: (-(-m // meta["BLOCK_M"]), -(-k // meta["BLOCK_K"]))](
                    x, scale, rows, columns, amax, m, k, LARGEST=largest)
        return rows, columns, amax

    return cast_op


_op = LazyOp(_register)
"""The registered op (triton_support.LazyOp)."""


def register_for(tensor: torch.Tensor) -> None:
    """Registers the op now where float8 layers on `tensor`'s device will call it (see `available`), so
    that a compiled layer finds it registered rather than registering it mid-trace."""
    if runs_on(tensor, in_compiled_layers=True):
        _op()


def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x * scale saturated into float8 `dtype` [M, K], the same values transposed [K, M] contiguous,
    max |x| as a 0-d fp32) for a tensor the kernel can read (`available`) and a 0-d fp32 `scale`."""
    return _op()(x, scale, dtype)
