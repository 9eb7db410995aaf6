"""The chunked loss's softmax, loss and logits gradient as one hand-written Triton kernel.

`softmax_loss_gradient_(logits [c, V], targets [c], scale [c], valid_columns)` returns the
per-token fp32 losses and log-sum-exp and overwrites `logits` (bf16 or fp16, rows contiguous)
with the gradient of sum(scale * losses) with respect to them: (softmax - one-hot) * scale,
zero at the columns >= valid_columns (the vocabulary padding). It is the same function as
`linear_cross_entropy._softmax_loss_gradient`, which torch.compile turns into several passes;
this kernel makes two: one program per row reads the row once for an online max and sum of
exponentials, then once more to write the gradient over it. That is 2 reads and 1 write of
the low-precision logits, the floor for a loss whose gradient needs the whole row's sum.

Under tensor parallelism each rank holds a slice of the vocabulary and the row's sum spans the
ranks, so the same two passes are two kernels with a collective between them: `row_statistics`
(each rank's log-sum-exp and, where it owns the target, the target's logit), then, once the
caller has combined the ranks' statistics, `logits_gradient_` against the global log-sum-exp.

Triton is imported on first use, so the package imports without it. `available(tensor)` says
whether this kernel can run on that tensor: low-precision logits on CUDA with Triton installed,
or on CPU under Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run it).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions.triton_support import runs_on

BLOCK = 4096
"""Columns per step of a row's loops: 19 steps over Qwen3's 151,936-entry vocabulary."""
NUM_WARPS = 8
SCALE_BLOCK, SCALE_PROGRAMS = 4096, 1024
"""`scale_unless_one_`'s elements per program and loop step, and its programs (a grid-stride loop)."""


def available(tensor: torch.Tensor) -> bool:
    """True where the kernel can run on `tensor`: bf16/fp16 logits on CUDA with Triton installed, or on
    CPU under Triton's interpreter."""
    return tensor.dtype in (torch.bfloat16, torch.float16) and runs_on(tensor, in_compiled_layers=False)


def _kernels():
    """(the one-rank fused kernel, the row statistics and the gradient of the tensor-parallel pair, the
    scaling of the gradients made in forward),
    imported on first use (triton.jit reads TRITON_INTERPRET then, at the kernels' import)."""
    from megatron.core.fusions import fused_cross_entropy_kernels as kernels

    return kernels.softmax_loss_gradient, kernels.row_statistics, kernels.logits_gradient, kernels.scale_unless_one


def _check_logits(logits: torch.Tensor, valid_columns: int, least: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be [c, V] bf16/fp16 with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    if not least <= valid_columns <= logits.shape[1]:
        raise ValueError(f"valid_columns={valid_columns} must lie in [{least}, {logits.shape[1]}]")


def softmax_loss_gradient_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, valid_columns: int,
                           block: Optional[int] = None, num_warps: Optional[int] = None):
    """(losses [c] fp32, log-sum-exp [c] fp32, logits overwritten by their gradient). `targets`
    must lie below `valid_columns` (>= 1); `scale` is fp32. `block` and `num_warps`: the launch
    configuration (default BLOCK and NUM_WARPS; tools/benchmark/step_parts.py times others)."""
    _check_logits(logits, valid_columns, least=1)
    rows = logits.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if rows:
        _kernels()[0][(rows,)](
            logits, logits.stride(0), targets.contiguous(), scale.float().contiguous(), losses, lse,
            logits.shape[1], valid_columns, BLOCK=block or BLOCK, num_warps=num_warps or NUM_WARPS)
    return losses, lse, logits


def row_statistics(logits: torch.Tensor, targets: torch.Tensor, valid_columns: int):
    """A tensor-parallel rank's half of the loss: (log-sum-exp of each row over this rank's valid
    columns [c] fp32, -inf where it has none; the target's logit [c] fp32, 0 where `targets` is -1,
    i.e. another rank owns the target). `targets` index this rank's columns. One pass over the logits."""
    _check_logits(logits, valid_columns, least=0)
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    target_logit = torch.empty_like(lse)
    if logits.shape[0]:
        _kernels()[1][(logits.shape[0],)](
            logits, logits.stride(0), targets.contiguous(), lse, target_logit, valid_columns,
            BLOCK=BLOCK, num_warps=NUM_WARPS)
    return lse, target_logit


def logits_gradient_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                     valid_columns: int) -> torch.Tensor:
    """The other half: overwrites `logits` with (softmax - one-hot) * scale, the softmax taken against
    the whole vocabulary's log-sum-exp `lse` [c] fp32 (all ranks' statistics combined), the one-hot only
    where `targets` (this rank's column, or -1) is owned, zero at the columns >= valid_columns."""
    _check_logits(logits, valid_columns, least=0)
    if logits.shape[0]:
        _kernels()[2][(logits.shape[0],)](
            logits, logits.stride(0), targets.contiguous(), lse.contiguous(), scale.float().contiguous(),
            logits.shape[1], valid_columns, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logits


def scale_unless_one_(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """tensor *= factor (one element) in place, without a pass over `tensor` when factor is exactly 1.

    On CUDA with Triton one kernel does it: each program reads the factor on the device and returns at
    once when it is 1, so the host never waits for it (a host read drains the launch queue, and the
    GPU then idles until the next launches arrive: measured to cost as much as the pass it skipped).
    On CPU the host reads the factor (no queue to drain there); under Triton's interpreter the kernel
    runs, as in the tests. On CUDA without Triton the multiply always runs."""
    if tensor.numel() == 0:
        return tensor
    if runs_on(tensor, in_compiled_layers=False) and tensor.is_contiguous() and factor.numel() == 1:
        programs = min(SCALE_PROGRAMS, -(-tensor.numel() // SCALE_BLOCK))
        _kernels()[3][(programs,)](tensor, factor, tensor.numel(), BLOCK=SCALE_BLOCK, num_warps=NUM_WARPS)
    elif tensor.is_cuda or factor.numel() != 1 or factor.item() != 1.0:
        tensor.mul_(factor)
    return tensor
