"""The Triton kernels of the float8 casts (imported on first use, where Triton is installed): the cast by a
given scale (fused_float8_cast.py) and SwiGLU fused with the casts on either side of it
(fused_float8_swiglu.py). Each program reads a [BLOCK_M, BLOCK_K] tile of a [M, K] input and writes
the tile's float8 values in both layouts and the tile's amax.

At module level so that the kernels can call `store_both` and `tile_amax` as ordinary jitted functions
(Triton looks callees up among the module's globals)."""

import triton
import triton.language as tl


@triton.jit
def store_both(value, rows_ptr, columns_ptr, m, k, row_stride, M, mask, scale, LARGEST: tl.constexpr):
    # A 16-bit tile scaled into float8 (saturating, to nearest, as torch's cast): at [m, k] of the rows (row
    # stride `row_stride`) and, the 16-bit tile transposed in registers, at [k, m] of the columns (row
    # stride M). Transposing the 16-bit tile and converting again beat shuffling float8 bytes.
    rows = tl.minimum(tl.maximum(value.to(tl.float32) * scale, -LARGEST), LARGEST)
    tl.store(rows_ptr + m.to(tl.int64)[:, None] * row_stride + k[None, :],
             rows.to(rows_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    columns = tl.minimum(tl.maximum(tl.trans(value).to(tl.float32) * scale, -LARGEST), LARGEST)
    tl.store(columns_ptr + k.to(tl.int64)[:, None] * M + m[None, :],
             columns.to(columns_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))


@triton.jit
def tile(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # This program's rows and columns of the [M, K] grid, and which of them exist.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    return m, k, (m < M)[:, None] & (k < K)[None, :]


@triton.jit
def tile_amax(value):
    return tl.max(tl.max(tl.abs(value.to(tl.float32)), axis=1), axis=0)


@triton.jit
def cast(x_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    m, k, mask = tile(M, K, BLOCK_M, BLOCK_K)
    x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tile_amax(x))  # |x| >= 0: the float max orders like the integer one
    store_both(x, rows_ptr, columns_ptr, m, k, K, M, mask, tl.load(scale_ptr), LARGEST)


@triton.jit
def swiglu(h_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # h [M, 2K] (rows [gate; up]) -> silu(gate) * up [M, K], cast.
    m, k, mask = tile(M, K, BLOCK_M, BLOCK_K)
    at = h_ptr + m.to(tl.int64)[:, None] * 2 * K + k[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + K, mask=mask, other=0.0).to(tl.float32)
    value = (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty)  # fused_swiglu's value and rounding
    tl.atomic_max(amax_ptr, tile_amax(value))
    store_both(value, rows_ptr, columns_ptr, m, k, K, M, mask, tl.load(scale_ptr), LARGEST)


@triton.jit
def swiglu_backward(grad_ptr, h_ptr, scale_ptr, rows_ptr, columns_ptr, amax_ptr, M, K, LARGEST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # grad [M, K] and h [M, 2K] -> h's gradient [M, 2K] ([d gate; d up]), cast.
    m, k, mask = tile(M, K, BLOCK_M, BLOCK_K)
    grad = tl.load(grad_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    at = h_ptr + m.to(tl.int64)[:, None] * 2 * K + k[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + K, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    d_up = (grad * gate * sigmoid).to(grad_ptr.dtype.element_ty)  # fused_swiglu's backward and rounding
    d_gate = (grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).to(grad_ptr.dtype.element_ty)
    tl.atomic_max(amax_ptr, tl.maximum(tile_amax(d_gate), tile_amax(d_up)))
    scale = tl.load(scale_ptr)
    store_both(d_gate, rows_ptr, columns_ptr, m, k, 2 * K, M, mask, scale, LARGEST)
    store_both(d_up, rows_ptr + K, columns_ptr + tl.cast(K, tl.int64) * M, m, k, 2 * K, M, mask, scale, LARGEST)
