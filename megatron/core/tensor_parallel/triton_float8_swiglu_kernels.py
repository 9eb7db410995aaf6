"""The Triton kernels of triton_float8_swiglu.py (imported on first use, where Triton is installed).

At module level so that both kernels can call `store_both` as an ordinary jitted function (Triton looks
callees up among the module's globals)."""

import triton
import triton.language as tl


@triton.jit
def store_both(value, rows_ptr, columns_ptr, m, k, row_stride, M, mask, scale, LARGEST: tl.constexpr):
    # A rounded 16-bit tile scaled into float8 (saturating, to nearest): at [m, k] of the rows (row
    # stride `row_stride`) and, transposed in registers, at [k, m] of the columns (row stride M).
    rows = tl.minimum(tl.maximum(value.to(tl.float32) * scale, -LARGEST), LARGEST)
    tl.store(rows_ptr + m.to(tl.int64)[:, None] * row_stride + k[None, :],
             rows.to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    columns = tl.minimum(tl.maximum(tl.trans(value).to(tl.float32) * scale, -LARGEST), LARGEST)
    tl.store(columns_ptr + k.to(tl.int64)[:, None] * M + m[None, :],
             columns.to(columns_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))


@triton.jit
def tile_amax(value):
    return tl.max(tl.max(tl.abs(value.to(tl.float32)), axis=1), axis=0)


@triton.jit
def forward(h_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, F, LARGEST: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (m < M)[:, None] & (k < F)[None, :]
    at = h_ptr + m.to(tl.int64)[:, None] * 2 * F + k[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + F, mask=mask, other=0.0).to(tl.float32)
    value = (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty)  # triton_swiglu's value and rounding
    tl.atomic_max(amax_ptr, tile_amax(value))  # |value| >= 0: the float max orders like the integer one
    store_both(value, rows_ptr, columns_ptr, m, k, F, M, mask, tl.load(scale_ptr), LARGEST)


@triton.jit
def backward(grad_ptr, h_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, F, LARGEST: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (m < M)[:, None] & (k < F)[None, :]
    grad = tl.load(grad_ptr + m.to(tl.int64)[:, None] * F + k[None, :], mask=mask, other=0.0).to(tl.float32)
    at = h_ptr + m.to(tl.int64)[:, None] * 2 * F + k[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + F, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    d_up = (grad * gate * sigmoid).to(grad_ptr.dtype.element_ty)  # triton_swiglu's backward and rounding
    d_gate = (grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).to(grad_ptr.dtype.element_ty)
    tl.atomic_max(amax_ptr, tl.maximum(tile_amax(d_gate), tile_amax(d_up)))
    scale = tl.load(scale_ptr)
    store_both(d_gate, rows_ptr, columns_ptr, m, k, 2 * F, M, mask, scale, LARGEST)
    store_both(d_up, rows_ptr + F, columns_ptr + tl.cast(F, tl.int64) * M, m, k, 2 * F, M, mask, scale, LARGEST)
