"""The chunked loss's softmax, loss and logits gradient as one hand-written Triton kernel.

`softmax_loss_gradient_(logits [c, V], targets [c], scale [c], valid_columns)` returns the
per-token fp32 losses and log-sum-exp and overwrites `logits` (bf16 or fp16, rows contiguous)
with the gradient of sum(scale * losses) with respect to them: (softmax - one-hot) * scale,
zero at the columns >= valid_columns (the vocabulary padding). It is the same function as
`linear_cross_entropy._softmax_loss_gradient`, which torch.compile turns into several passes;
this kernel makes two: one program per row reads the row once for an online max and sum of
exponentials, then once more to write the gradient over it. That is 2 reads and 1 write of
the low-precision logits, the floor for a loss whose gradient needs the whole row's sum.

Triton is imported on first use, so the package imports without it. `available(tensor)` says
whether this kernel can run on that tensor: low-precision logits on CUDA with Triton installed,
or on CPU under Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK = 4096
"""Columns per step of a row's loops: 19 steps over Qwen3's 151,936-entry vocabulary."""
NUM_WARPS = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _has_triton() -> bool:
    """Looked up once: the loss asks for every chunk."""
    return importlib.util.find_spec("triton") is not None


def available(tensor: torch.Tensor) -> bool:
    """True where the kernel can run on `tensor`: bf16/fp16 logits on CUDA with Triton installed, or on
    CPU under Triton's interpreter."""
    if tensor.dtype not in (torch.bfloat16, torch.float16) or not _has_triton():
        return False
    return tensor.is_cuda or (_interpreting() and tensor.device.type == "cpu")


@functools.cache
def _kernel(interpreting: bool):
    """The jitted kernel, built on first use (once per interpreter setting: triton.jit reads it)."""
    del interpreting  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_loss_gradient(logits_ptr, row_stride, targets_ptr, scale_ptr, losses_ptr, lse_ptr,
                              columns, valid_columns, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        offsets = tl.arange(0, BLOCK)
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.zeros((), tl.float32)
        for start in range(0, valid_columns, BLOCK):
            x = tl.load(base + start + offsets, mask=start + offsets < valid_columns,
                        other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target = tl.load(targets_ptr + row)
        tl.store(losses_ptr + row, lse - tl.load(base + target).to(tl.float32))
        tl.store(lse_ptr + row, lse)
        scale = tl.load(scale_ptr + row)
        for start in range(0, columns, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < valid_columns, other=float("-inf")).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < columns)

    return softmax_loss_gradient


def softmax_loss_gradient_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, valid_columns: int):
    """(losses [c] fp32, log-sum-exp [c] fp32, logits overwritten by their gradient). `targets`
    must lie below `valid_columns` (>= 1); `scale` is fp32."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be [c, V] bf16/fp16 with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    if not 1 <= valid_columns <= logits.shape[1]:
        raise ValueError(f"valid_columns={valid_columns} must lie in [1, {logits.shape[1]}]")
    rows = logits.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if rows:
        _kernel(_interpreting())[(rows,)](
            logits, logits.stride(0), targets.contiguous(), scale.float().contiguous(), losses, lse,
            logits.shape[1], valid_columns, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return losses, lse, logits
