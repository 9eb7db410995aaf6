"""Delayed scaling's float8 cast in one pass: a Triton kernel (`--fp8-recipe delayed`).

Under delayed scaling (float8_scaling.py) a float8 layer's cast needs no amax before it: the scale is
given. So one read of each tile does the whole cast: scale it in fp32, saturate it at the dtype's largest
value, round it to float8 (to nearest, as torch's cast: `float8_matmul.scaled_cast`'s values, bit for
bit) and write it row-major; transpose the 16-bit tile in registers and shared memory and write its
float8 values again column-major (the weight gradient's layout); and take the tile's amax into the
tensor's (one atomic max a tile), which the layer records. Compiled as tensor math the same cast is two
passes (Inductor writes the transposed copy in a pass of its own): on an H100 fc2's input [8192 x 14336]
took 0.29 ms that way and 0.17 in this kernel, fc1's output gradient [8192 x 28672] 0.55 and 0.35
(docs/performance_history.md). Two earlier kernels that transposed the float8 tile instead, with one fixed tile
shape, were no faster than the tensor math; this one's tile shape is autotuned per width. The kernel is
in fused_float8_kernels.py with SwiGLU's fused casts (fused_float8_swiglu.py), which `launch` runs too.

`cast_both_layouts(x, scale, dtype)` is a `torch.library.triton_op`, so compiled layers trace it into
their graph, backward included, and returns (values [M, K], values transposed [K, M], amax): fresh
tensors, nothing mutated. Where it cannot run (no Triton; a CPU tensor outside a test that allows the
interpreter, see `triton_support`) callers cast as tensor math (`available`).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from megatron.core.fusions.triton_support import LazyOp, interpreting, runs_on

CONFIGS = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8),
           (32, 64, 4), (32, 128, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8)]
"""(BLOCK_M, BLOCK_K, warps) the autotuner tries on a GPU (its key: the shape). The smaller tiles and
the more warps per tile are for SwiGLU's backward, which holds six fp32 values an element."""
INTERPRETER_BLOCK = 16
"""The interpreter's tile side: small, so a test's shapes cover partial tiles."""


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can cast `x`: a contiguous 2-D floating tensor on CUDA with Triton installed
    (or on CPU under the interpreter where a test allows it)."""
    return x.dim() == 2 and x.is_floating_point() and x.is_contiguous() and runs_on(x, in_compiled_layers=True)


@functools.cache
def kernels(interpreter: bool) -> dict:
    """{name: kernel} of fused_float8_kernels.py (the cast, SwiGLU's two): autotuned over CONFIGS on a
    GPU, as jitted under the interpreter."""
    from megatron.core.fusions import fused_float8_kernels as module

    jitted = {name: getattr(module, name) for name in ("cast", "swiglu", "swiglu_backward")}
    if interpreter:
        return jitted
    import triton

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps) for bm, bk, warps in CONFIGS]
    return {name: triton.autotune(configs, key=["M", "K"])(kernel)  # the atomic max is idempotent: no restore
            for name, kernel in jitted.items()}


def launch(name: str, inputs: tuple, width: int, dtype: torch.dtype, tiles: Tuple[int, int]):
    """Runs kernel `name` over `tiles` = (M, K) with `inputs` (tensors, then the scale) into fresh outputs:
    (float8 `dtype` [M, width], the same transposed [width, M], the amax as a 0-d fp32). Inside a
    triton_op."""
    from torch.library import wrap_triton

    (m, k), like, interpreter = tiles, inputs[0], interpreting()
    rows, columns = like.new_empty((m, width), dtype=dtype), like.new_empty((width, m), dtype=dtype)
    amax = torch.zeros((), dtype=torch.float32, device=like.device)
    if rows.numel():
        kernel, largest = wrap_triton(kernels(interpreter)[name]), torch.finfo(dtype).max
        if interpreter:
            grid = (-(-m // INTERPRETER_BLOCK), -(-k // INTERPRETER_BLOCK))
            kernel[grid](*inputs, rows, columns, amax, m, k, LARGEST=largest, BLOCK_M=INTERPRETER_BLOCK,
                         BLOCK_K=INTERPRETER_BLOCK)
        else:
            kernel[lambda meta: (-(-m // meta["BLOCK_M"]), -(-k // meta["BLOCK_K"]))](
                *inputs, rows, columns, amax, m, k, LARGEST=largest)
    return rows, columns, amax


def _register():
    """The op (torch.library warns when it registers a triton_op without Triton: only where it is)."""
    from torch.library import triton_op

    @triton_op("megadlms::float8_cast_both_layouts", mutates_args=())
    def cast_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch("cast", (x, scale), x.shape[1], dtype, x.shape)

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
