"""tools/benchmark/float8_cast_candidate.py: the candidate cast for delayed scaling that step_parts.py times.

It fails if a tile offset, mask, scale, saturation or the transposition writes other bytes than torch's
cast, or the atomic records another amax. Triton's interpreter rounds float8 its own way, so on CPU the
inputs lie on the float8 grid once scaled (where the cast is exact); on CUDA the rounding is checked
against torch's cast on random values."""

import sys
from pathlib import Path

import pytest
import torch

from megatron.core import triton_support
from megatron.core.tensor_parallel.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, scaled_cast

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "benchmark"))
import float8_cast_candidate  # noqa: E402

DTYPES = {"e4m3": FORWARD_DTYPE, "e5m2": GRADIENT_DTYPES["hybrid"]}


def _on_grid(rows: int, cols: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """bf16 values on `dtype`'s normal numbers once multiplied by `scale` (a power of two), some far past
    its largest (saturated)."""
    codes = torch.randint(0, 256, (rows, cols), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    values = codes.view(dtype).float()
    tiny = torch.finfo(dtype).tiny
    values = torch.where(values.isfinite() & (values.abs() >= tiny), values, torch.full_like(values, tiny))
    values[::7, ::5] = 1e9
    values[1::11, 2::3] *= -1e9
    return (values / scale).to(torch.bfloat16)


def _check(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reload: bool) -> None:
    amax = torch.tensor(0.25, device=x.device)
    rows, columns = float8_cast_candidate.cast_both_layouts(x, scale, dtype, amax, reload)
    expected = scaled_cast(x, scale, dtype)
    assert rows.dtype == columns.dtype == dtype and columns.is_contiguous()
    assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(columns.view(torch.uint8), expected.t().contiguous().view(torch.uint8))
    assert torch.equal(amax, x.abs().max().float())
    larger = 2 * amax
    float8_cast_candidate.cast_both_layouts(x, scale, dtype, larger, reload)
    assert torch.equal(larger, 2 * x.abs().max().float())  # a larger running amax stays


@pytest.mark.skipif(not (triton_support.HAS_TRITON and triton_support.interpreting()),
                    reason="CPU tensors under Triton's interpreter (CPU machines run it)")
@pytest.mark.parametrize("shape", [(40, 56), (32, 48), (17, 33)], ids=["partial-tiles", "whole-tiles", "odd"])
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("reload", [False, True], ids=["transposed", "reloaded"])
def test_the_candidate_writes_both_layouts_of_torchs_cast_on_cpu(shape, name, reload):
    dtype, scale = DTYPES[name], torch.tensor(8.0)
    _check(_on_grid(*shape, dtype, scale.item()), scale, dtype, reload)


@pytest.mark.skipif(not (triton_support.HAS_TRITON and torch.cuda.is_available()), reason="a CUDA case")
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("reload", [False, True], ids=["transposed", "reloaded"])
def test_the_candidate_rounds_as_torch_on_cuda(name, reload):
    dtype = DTYPES[name]
    x = torch.randn(1000, 777, device="cuda").to(torch.bfloat16) * 30
    _check(x, torch.tensor(3.7, device="cuda"), dtype, reload)
