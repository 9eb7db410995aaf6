"""SwiGLU fused with the float8 casts around it: two Triton kernels for the float8 MLP (float8_mlp.py).

In a float8 MLP with a given scale (delayed scaling, float8_scaling.py) SwiGLU's output is only ever read
by fc2's cast, and SwiGLU's input gradient only by fc1's cast. So each kernel here does both in one
pass over a tile and writes no 16-bit tensor:

* forward: fc1's output `h [M, 2f]` (each row [gate; up]) -> `silu(gate) * up` rounded to h's dtype,
  then scaled, saturated and rounded to float8 as `fused_float8_cast` does: the values [M, f] and the
  same transposed [f, M] (fc2's weight-gradient layout), and the amax of the rounded activation;
* backward: the activation's gradient `g [M, f]` and `h` -> SwiGLU's input gradient [M, 2f] rounded to
  g's dtype, cast the same way into [M, 2f] and [2f, M] (fc1's two backward GEMMs), with its amax.

Every value is the one the unfused kernels give (fused_swiglu.py, then fused_float8_cast.py): the same
fp32 arithmetic, one rounding to 16 bits, then the cast. What the fusion saves is the 16-bit tensor's
write and read: 4 bytes an element of the activation in the forward, 8 in the backward (at the
`7b-shape`, 8,192 tokens x 14,336, 1.4 GB a layer and micro-batch).

The kernels live beside the cast's in fused_float8_kernels.py (one tile store for all three) and launch
through `fused_float8_cast.launch`. Both ops are `torch.library.triton_op`s returning fresh tensors,
traced into compiled layers like the cast.
`available(h)` says where they run (CUDA with Triton; CPU under the interpreter where a test allows it).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron.core.fusions.fused_float8_cast import launch
from megatron.core.fusions.triton_support import LazyOp, runs_on


def available(x: torch.Tensor) -> bool:
    """Whether the kernels can read `x` (fc1's output or the activation's gradient): a contiguous 2-D
    floating tensor on CUDA with Triton (or on CPU under the interpreter where a test allows it)."""
    return x.dim() == 2 and x.is_floating_point() and x.is_contiguous() and runs_on(x, in_compiled_layers=True)


def _register():
    """The two ops (torch.library warns when it registers a triton_op without Triton: only where it is)."""
    from torch.library import triton_op

    @triton_op("megadlms::float8_swiglu", mutates_args=())
    def forward_op(h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = h.shape[1] // 2
        return launch("swiglu", (h, scale), f, dtype, (h.shape[0], f))

    @triton_op("megadlms::float8_swiglu_backward", mutates_args=())
    def backward_op(grad: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch("swiglu_backward", (grad, h, scale), h.shape[1], dtype, grad.shape)

    return forward_op, backward_op


_ops = LazyOp(_register)
"""The registered ops (triton_support.LazyOp)."""


def register_for(tensor: torch.Tensor) -> None:
    """Registers the ops now where float8 MLPs on `tensor`'s device will call them (see `available`)."""
    if runs_on(tensor, in_compiled_layers=True):
        _ops()


def swiglu_cast(h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU of fc1's output `h [M, 2f]` cast into float8 `dtype` by `scale`: (values [M, f], the same
    transposed [f, M], the amax of the activation before the cast)."""
    return _ops()[0](h, scale, dtype)


def swiglu_backward_cast(grad: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU's input gradient from the activation's gradient `grad [M, f]` (h's dtype) and `h`, cast into
    float8 `dtype` by `scale`: (values [M, 2f], the same transposed [2f, M], its amax before the cast)."""
    return _ops()[1](grad, h, scale, dtype)
