"""Float8 GEMMs for the chunked output layer (`--fp8-output-layer`): tensorwise-scaled e4m3 / e5m2
operands through `torch._scaled_mm`.

The decoder's linears train in fp8 through torchao (transformer/fp8.py); the output layer is not
an `nn.Linear` there but the chunked loss of linear_cross_entropy.py, so its GEMMs are cast here.
Two of its three GEMMs run in fp8: the logits (chunk of hidden states x weight^T) and the input
gradient (logits gradient x weight). The weight gradient stays in the compute dtype, accumulated in
fp32 across chunks, as torchao's recipes that keep the weight gradient in high precision do.

Scaling is tensorwise and dynamic: each operand is multiplied by max(dtype) / amax(operand) before
the cast (saturating), and the GEMM multiplies the product back by both inverses. Forward operands
are e4m3; the logits gradient is e5m2 under the hybrid format (Megatron's meaning), e4m3 under
e4m3. cuBLAS wants the first operand row-major, the second column-major and every dimension a
multiple of 16: rows are padded with zeros to a multiple of 16 (after the cast, on the 1-byte
copy) and the weight is kept in both layouts (two copies of V/tp x h bytes). On CUDA the cast is
compiled: one reduction for the amax and one pass that scales, saturates and casts, instead of
an fp32 copy of a [chunk, V/tp] logits gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPES = {"hybrid": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
ALIGNMENT = 16


def _cast(tensor: torch.Tensor, dtype: torch.dtype):
    largest = torch.finfo(dtype).max
    amax = tensor.detach().abs().amax().float().clamp(min=1e-12)
    scale = largest / amax
    return (tensor.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


@functools.cache
def _compiled_cast():
    return torch.compile(_cast, dynamic=True)


def to_float8(tensor: torch.Tensor, dtype: torch.dtype):
    """(tensor in `dtype`, scaled so that its amax lands on the dtype's largest value; the inverse scale,
    a 0-d fp32 tensor the GEMM multiplies back)."""
    return (_compiled_cast() if tensor.is_cuda else _cast)(tensor, dtype)


def _pad_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 [rows, k] padded with zero rows to a multiple of ALIGNMENT (through its bytes)."""
    rows = tensor.shape[0]
    padded = -(-rows // ALIGNMENT) * ALIGNMENT
    if padded == rows:
        return tensor
    return torch.nn.functional.pad(tensor.view(torch.uint8), (0, 0, 0, padded - rows)).view(tensor.dtype)


@dataclass
class Float8Weight:
    """A [V/tp, h] weight cast once per forward: row-major (for the logits) and transposed (for the
    input gradient), with its inverse scale."""

    rows: torch.Tensor
    columns: torch.Tensor
    inverse_scale: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Float8Weight":
        if weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT:
            raise ValueError(f"--fp8-output-layer needs the output layer's [V/tp, h] = {tuple(weight.shape)} in "
                             f"multiples of {ALIGNMENT} (pad the vocabulary with --make-vocab-size-divisible-by)")
        rows, inverse = to_float8(weight, FORWARD_DTYPE)
        return cls(rows, rows.t().contiguous(), inverse)


def logits(hidden: torch.Tensor, weight: Float8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """hidden [c, h] @ weight^T -> [c, V/tp] in `out_dtype`, both operands e4m3."""
    count = hidden.shape[0]
    hidden8, inverse = to_float8(hidden, FORWARD_DTYPE)
    product = torch._scaled_mm(_pad_rows(hidden8), weight.rows.t(), scale_a=inverse, scale_b=weight.inverse_scale,
                               out_dtype=out_dtype)
    return product[:count]


def input_gradient(grad_logits: torch.Tensor, weight: Float8Weight, fmt: str) -> torch.Tensor:
    """grad_logits [c, V/tp] @ weight -> [c, h] in fp32, the gradient in the format's gradient dtype."""
    count = grad_logits.shape[0]
    grad8, inverse = to_float8(grad_logits, GRADIENT_DTYPES[fmt])
    product = torch._scaled_mm(_pad_rows(grad8), weight.columns.t(), scale_a=inverse, scale_b=weight.inverse_scale,
                               out_dtype=torch.float32)
    return product[:count]
