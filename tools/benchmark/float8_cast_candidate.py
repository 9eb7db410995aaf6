"""A candidate float8 cast for delayed scaling, timed by step_parts.py before it may enter the layers.

Delayed scaling's cast (float8_matmul._cast_both_layouts with a given scale) writes a tensor's float8
values twice, row-major for the forward or input-gradient GEMM and transposed for the weight
gradient's, and its amax beside them. Compiled, it ran at 1.7 TB/s on an H200 against a 4.1 TB/s
copy (docs/performance.md); a Triton kernel that transposed the float8 tile ran at 1.5. This one reads
a tile of the 16-bit tensor once, writes its float8 values row-major, transposes the 16-bit tile (not the
float8 one: byte-wide shared-memory shuffles were the removed kernel's suspected cost) and converts it
again for the transposed store, and raises the running amax by the tile's with one atomic max; or
(`reload`) reads the tile a second time in transposed order, from L2, instead of transposing it. The
tile shape is autotuned per width and way.

`cast_both_layouts(x, scale, dtype, amax)` returns (values [M, K], values transposed [K, M]); its values
are `float8_matmul.scaled_cast`'s bit for bit (tests/unit_tests/test_float8_cast_candidate.py runs it
under Triton's interpreter). Only step_parts.py calls it: it enters the float8 layers only if it beats
the compiled tensor math there.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

CONFIGS = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8)]
"""(BLOCK_M, BLOCK_K, warps) the autotuner tries on a GPU."""
INTERPRETER_BLOCK = 16
"""The interpreter's tile side: small, so a test's shapes cover partial tiles."""


@functools.cache
def _kernel(interpreting: bool):
    """The jitted kernel; autotuned over CONFIGS on a GPU, one small tile under the interpreter."""
    import triton
    import triton.language as tl

    def cast_transpose(x_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr,
                       RELOAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                    other=0.0)
        scale = tl.load(scale_ptr)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))  # |x| >= 0
        rows = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -LARGEST), LARGEST)
        tl.store(rows_ptr + m.to(tl.int64)[:, None] * K + k[None, :],
                 rows.to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=(m < M)[:, None] & (k < K)[None, :])
        if RELOAD:  # the tile read again transposed (from L2: the first read just brought it there)
            x_t = tl.load(x_ptr + m.to(tl.int64)[None, :] * K + k[:, None],
                          mask=(k < K)[:, None] & (m < M)[None, :], other=0.0)
        else:  # the 16-bit tile transposed in registers and shared memory, [BLOCK_K, BLOCK_M]
            x_t = tl.trans(x)
        columns = tl.minimum(tl.maximum(x_t.to(tl.float32) * scale, -LARGEST), LARGEST)
        tl.store(columns_ptr + k.to(tl.int64)[:, None] * M + m[None, :],
                 columns.to(columns_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=(k < K)[:, None] & (m < M)[None, :])

    jitted = triton.jit(cast_transpose)
    if interpreting:
        return jitted
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps) for bm, bk, warps in CONFIGS]
    return triton.autotune(configs, key=["M", "K", "RELOAD"], restore_value=["amax_ptr"])(jitted)


def cast_both_layouts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor,
                      reload: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x * scale saturated into float8 `dtype` [M, K], the same values transposed [K, M], contiguous) for a
    contiguous 2-D 16-bit `x` and a 0-d fp32 `scale`; raises the 0-d fp32 `amax` to max |x|. `reload`:
    the transposed values from a second, transposed read of the tile instead of a transpose of the first."""
    from megatron.core.triton_support import interpreting

    (m, k), interpreter = x.shape, interpreting()
    rows, columns = x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype)
    kernel, largest = _kernel(interpreter), torch.finfo(dtype).max
    if interpreter:
        grid = (-(-m // INTERPRETER_BLOCK), -(-k // INTERPRETER_BLOCK))
        kernel[grid](x, scale, rows, columns, amax, m, k, LARGEST=largest, RELOAD=reload,
                     BLOCK_M=INTERPRETER_BLOCK, BLOCK_K=INTERPRETER_BLOCK)
    else:
        kernel[lambda meta: (-(-m // meta["BLOCK_M"]), -(-k // meta["BLOCK_K"]))](
            x, scale, rows, columns, amax, m, k, LARGEST=largest, RELOAD=reload)
    return rows, columns
