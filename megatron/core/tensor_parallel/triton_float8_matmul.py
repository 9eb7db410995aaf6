"""The float8 weight gradient added into the fp32 `.grad` by its GEMM: a Triton kernel.

Within `fp32_weight_grad.accumulating_into_grad()` (a step's micro-batches after the first) the bf16
linear layers add their weight gradient into `.grad` through cuBLAS's beta = 1. `torch._scaled_mm` has
no beta, so the float8 layers' weight gradient (`float8_matmul.float8_linear`) would leave its GEMM as
a fresh fp32 tensor that autograd then adds to `.grad` in a pass of its own: 16 bytes a parameter moved
(write the product; read it and the sum, write the sum) where the GEMM's epilogue needs 8 (read the sum,
write it). At the `7b-shape` (1.75B decoder linear parameters) that is 14 GB a micro-batch.

`accumulate_float8_matmul_(out, a, b, scale_a, scale_b)` computes `out += (a @ b^T) * scale_a * scale_b`
with a [M, K] and b [N, K] in float8, both K-major (what the backward has: the output gradient's
transposed cast and the input's saved transposed copy), out [M, N] fp32 and the two 0-d inverse scales.
The products are summed in fp32 as cuBLAS does without fast accumulation (what `_scaled_mm` runs for the
weight gradient): the tensor cores' float8 sums, which keep fewer bits, are promoted into the fp32
accumulator after every `PROMOTE_EVERY` products of the inner dimension (Triton's
`max_num_imprecise_acc`). a and b are read through tensor descriptors (TMA, zeros past their edges);
the tile shape is autotuned per (M, N, K) on CUDA, the sum restored between trials. The kernel's gain
is the add's memory traffic, which a GEMM slower than cuBLAS's can lose, so on CUDA the op times both
ways when it first meets a shape and keeps the faster (`uses_kernel`). Where the kernel does not run
(no Triton; a CPU tensor outside a test that allows the interpreter, see `triton_support`; the slower
way; deterministic mode; operands a descriptor cannot read) the op adds `_scaled_mm`'s fp32 product, the
same sum autograd makes.
"""

from __future__ import annotations

import functools
import warnings
from typing import Dict, Tuple

import torch

from megatron.core.triton_support import interpreting, runs_on

PROMOTE_EVERY = 128
"""Products of the inner dimension the tensor cores sum in float8 precision before the fp32 accumulator
takes them (None: never, the fast accumulation of the forward GEMMs)."""
TILES = ((128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 5), (128, 128, 4, 4), (128, 128, 4, 3))
"""The autotuned configurations: BLOCK_M, BLOCK_N, warps, pipeline stages (BLOCK_K 128). The last fits two
programs on an SM (98 KB of shared memory, 128 threads of 255 registers), so that one's products run while
the other waits to promote its sums."""
INTERPRETER_TILE = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
"""The one configuration the interpreter runs (small, so tests cover partial tiles and the grouping)."""


@functools.cache
def _kernel(interpreting: bool):
    """The jitted kernel (once per interpreter setting: triton.jit reads it)."""
    del interpreting  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def accumulate(a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, M, N, K, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROMOTE: tl.constexpr):
        # tiles in groups of GROUP_M rows, so that consecutive programs share a's and b's tiles in L2
        pid, tiles_n = tl.program_id(0), tl.cdiv(N, BLOCK_N)
        first_m = pid // (GROUP_M * tiles_n) * GROUP_M
        group_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
        pid_m = first_m + pid % (GROUP_M * tiles_n) % group_m
        pid_n = pid % (GROUP_M * tiles_n) // group_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):  # the descriptors' loads read zeros past M, N and K
            a = a_desc.load([pid_m * BLOCK_M, start])
            b = b_desc.load([pid_n * BLOCK_N, start])
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
        # `out` read and written half the columns at a time: fewer registers live beside the tile's sums
        # (none spilled at 128 x 256 on sm_90, where a whole [128, 256] fp32 tile of `out` spilled)
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + offsets, tl.load(out_ptr + offsets, mask=mask) + left, mask=mask)
        offsets += BLOCK_N // 2
        mask = (rows < M)[:, None] & (cols + BLOCK_N // 2 < N)[None, :]
        tl.store(out_ptr + offsets, tl.load(out_ptr + offsets, mask=mask) + right, mask=mask)

    return accumulate


def _set_blocks(nargs: dict) -> None:
    """An autotuning configuration's tile on the two descriptors (their block shapes are part of them)."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


@functools.cache
def _autotuned():
    """The kernel autotuned over TILES per (M, N, K, promotion); each trial adds into `out`, restored after it."""
    import triton

    configs = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, GROUP_M=8), num_warps=warps, num_stages=stages,
                             pre_hook=_set_blocks) for m, n, warps, stages in TILES]
    return triton.autotune(configs, key=["M", "N", "K", "PROMOTE"], restore_value=["out_ptr"])(_kernel(False))


def _launch(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = a.shape, b.shape[0]
    tile = INTERPRETER_TILE if interpreting() else dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)  # set per trial
    a_desc = TensorDescriptor.from_tensor(a, [tile["BLOCK_M"], tile["BLOCK_K"]])
    b_desc = TensorDescriptor.from_tensor(b, [tile["BLOCK_N"], tile["BLOCK_K"]])

    def grid(meta):
        return (-(-M // meta["BLOCK_M"]) * -(-N // meta["BLOCK_N"]),)
    if interpreting():
        promote = None if PROMOTE_EVERY is None else min(PROMOTE_EVERY, tile["BLOCK_K"])
        _kernel(True)[grid(tile)](a_desc, b_desc, out, scale_a, scale_b, M, N, K, PROMOTE=promote, **tile)
    else:
        _autotuned()[grid](a_desc, b_desc, out, scale_a, scale_b, M, N, K, PROMOTE=PROMOTE_EVERY)


def kernel_runs_on(out: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on `out` (else the op adds `_scaled_mm`'s product)."""
    return runs_on(out, in_compiled_layers=True)  # the backward of a compiled layer calls it


def _descriptor_ready(operand: torch.Tensor) -> bool:
    """Whether a float8 operand can be read through a tensor descriptor (TMA): contiguous rows of a
    multiple of 16 bytes, from a 16-byte-aligned address."""
    return operand.is_contiguous() and operand.shape[-1] % 16 == 0 and operand.data_ptr() % 16 == 0


def float8_product(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """(a [M, K] @ b [N, K]^T) * scale_a * scale_b in fp32 from cuBLAS's float8 GEMM (`_scaled_mm`)."""
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)


def _cublas(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor):
    out += float8_product(a, b, scale_a, scale_b)


CHOICES: Dict[Tuple[int, int, int, int], bool] = {}
"""(M, N, K, CUDA device) -> whether the kernel beat `_scaled_mm` + add when the op first met the shape."""


def _capturing(out: torch.Tensor) -> bool:
    return out.is_cuda and torch.cuda.is_current_stream_capturing()


def _kernel_wins(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor) -> bool:
    """On the first call of a shape, times the kernel (autotuned) against cuBLAS's GEMM and the add, and
    keeps the faster: the kernel's gain is the add's memory traffic, which a slower GEMM can lose."""
    key = (a.shape[0], b.shape[0], a.shape[1], out.device.index)
    if key in CHOICES:
        return CHOICES[key]
    if _capturing(out):
        return False  # no timing inside a CUDA graph's capture: cuBLAS's way, and time the shape later
    from triton.testing import do_bench

    saved = out.clone()
    try:
        kernel_ms = do_bench(lambda: _launch(out, a, b, scale_a, scale_b), return_mode="median")
    except Exception as error:  # a Triton that cannot build it: cuBLAS's way, said once a shape
        warnings.warn(f"the float8 weight-gradient kernel did not run for {key[:3]} ({type(error).__name__}: "
                      f"{error}); adding cuBLAS's product instead")
        kernel_ms = float("inf")
    cublas_ms = do_bench(lambda: _cublas(out, a, b, scale_a, scale_b), return_mode="median")
    out.copy_(saved)
    CHOICES[key] = kernel_ms < cublas_ms
    return CHOICES[key]


def uses_kernel(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                scale_b: torch.Tensor) -> bool:
    """Whether the op adds through the kernel: where it runs and, on CUDA, where it was the faster way
    for the shape (never under torch.use_deterministic_algorithms: which way wins can differ between
    runs, and the two ways round differently). Under Triton's interpreter (tests) always."""
    if not (kernel_runs_on(out) and _descriptor_ready(a) and _descriptor_ready(b) and out.is_contiguous()):
        return False
    if not out.is_cuda:
        return True
    return not torch.are_deterministic_algorithms_enabled() and _kernel_wins(out, a, b, scale_a, scale_b)


@torch.library.custom_op("megadlms::accumulate_float8_matmul_", mutates_args=("out",))
def accumulate_float8_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                              scale_b: torch.Tensor) -> None:
    """out (fp32 [M, N]) += (a [M, K] @ b [N, K]^T) * scale_a * scale_b, a and b float8: in
    the GEMM's epilogue where the kernel runs and wins (`uses_kernel`), else `_scaled_mm`'s fp32 product
    added."""
    (_launch if uses_kernel(out, a, b, scale_a, scale_b) else _cublas)(out, a, b, scale_a, scale_b)
