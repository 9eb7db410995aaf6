"""The Triton kernels of fused_cross_entropy.py (imported on first use, where Triton is installed).

They live at module level so that the kernels can call the two shared row loops as ordinary
jitted functions (Triton looks the callees up among the module's globals).
"""

import triton
import triton.language as tl


@triton.jit
def row_log_sum_exp(base, valid_columns, BLOCK: tl.constexpr):
    # One pass over a row's valid columns: an online max and sum of exponentials (-inf for none).
    offsets = tl.arange(0, BLOCK)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, valid_columns, BLOCK):
        x = tl.load(base + start + offsets, mask=start + offsets < valid_columns,
                    other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    return running_max + tl.log(running_sum)


@triton.jit
def write_gradient(base, columns, valid_columns, target, lse, scale, BLOCK: tl.constexpr):
    # (softmax - one-hot) * scale over the row, written over it; target -1: no one-hot here.
    offsets = tl.arange(0, BLOCK)
    for start in range(0, columns, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < valid_columns, other=float("-inf")).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=cols < columns)


@triton.jit
def softmax_loss_gradient(logits_ptr, row_stride, targets_ptr, scale_ptr, losses_ptr, lse_ptr,
                          columns, valid_columns, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lse = row_log_sum_exp(base, valid_columns, BLOCK)
    target = tl.load(targets_ptr + row)
    tl.store(losses_ptr + row, lse - tl.load(base + target).to(tl.float32))
    tl.store(lse_ptr + row, lse)
    write_gradient(base, columns, valid_columns, target, lse, tl.load(scale_ptr + row), BLOCK)


@triton.jit
def row_statistics(logits_ptr, row_stride, targets_ptr, lse_ptr, target_logit_ptr, valid_columns,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    tl.store(lse_ptr + row, row_log_sum_exp(base, valid_columns, BLOCK))
    target = tl.load(targets_ptr + row)
    owned = target >= 0
    logit = tl.load(base + tl.where(owned, target, 0)).to(tl.float32)
    tl.store(target_logit_ptr + row, tl.where(owned, logit, 0.0))


@triton.jit
def logits_gradient(logits_ptr, row_stride, targets_ptr, lse_ptr, scale_ptr, columns, valid_columns,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    write_gradient(logits_ptr + row * row_stride, columns, valid_columns, tl.load(targets_ptr + row),
                   tl.load(lse_ptr + row), tl.load(scale_ptr + row), BLOCK)


@triton.jit
def scale_unless_one(x_ptr, factor_ptr, numel, BLOCK: tl.constexpr):
    # x *= factor in place, a grid-stride loop; every program returns at once when factor is 1.
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        offsets = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            index = start + offsets
            x = tl.load(x_ptr + index, mask=index < numel)
            tl.store(x_ptr + index, (x.to(tl.float32) * factor).to(x_ptr.dtype.element_ty), mask=index < numel)
