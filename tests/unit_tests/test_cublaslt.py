"""cublaslt.scaled_mm_add_: out += scale_a * scale_b * a @ b_t^T into the same fp32 storage. On CPU it adds
`_scaled_mm`'s product (autograd's sum, to the bit); on a GPU with float8 GEMMs cuBLASLt's GEMM adds it
itself (beta = 1), which must be the same sum within fp32 rounding, for the float8 layers' dtype pairs
and for shapes whose three dimensions all differ (a swapped dimension or operand fails it)."""

import pytest
import torch

from megatron.core.fusions import cublaslt

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# float8 GEMMs need compute capability 8.9+ (Ada, Hopper); the `gpu` mark skips them without CUDA
OLD_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9)


def _operands(m: int, n: int, k: int, a_dtype, b_dtype, device: str):
    generator = torch.Generator().manual_seed(m + n + k)
    a = (torch.randn(m, k, generator=generator) * 4).to(a_dtype)
    b_t = (torch.randn(n, k, generator=generator) * 4).to(b_dtype)
    out = torch.randn(m, n, generator=generator) * 100
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(0.125)
    return [t.to(device) for t in (out, a, b_t, scale_a, scale_b)]


def _expected(out, a, b_t, scale_a, scale_b) -> torch.Tensor:
    return out + torch._scaled_mm(a, b_t.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)


def test_on_cpu_it_adds_the_scaled_product_in_place_to_the_bit():
    out, a, b_t, scale_a, scale_b = _operands(32, 48, 64, E5M2, E4M3, "cpu")
    expected, pointer = _expected(out, a, b_t, scale_a, scale_b), out.data_ptr()
    cublaslt.scaled_mm_add_(out, a, b_t, scale_a, scale_b)
    assert out.data_ptr() == pointer and torch.equal(out, expected)
    assert not cublaslt.available(out.device)


@pytest.mark.gpu
@pytest.mark.skipif(OLD_GPU, reason="needs a GPU with float8 GEMMs (compute capability 8.9+)")
@pytest.mark.parametrize("dtypes", [(E5M2, E4M3), (E4M3, E4M3)], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("shape", [(64, 32, 48), (384, 1024, 4096), (4096, 1536, 8192)])
def test_on_a_float8_gpu_cublaslt_adds_inside_its_gemm(dtypes, shape):
    assert cublaslt.available(torch.device("cuda"))  # the GEMM's own add, not the fallback
    out, a, b_t, scale_a, scale_b = _operands(*shape, *dtypes, "cuda")
    expected, before, pointer = _expected(out, a, b_t, scale_a, scale_b), out.clone(), out.data_ptr()
    tolerance = 1e-5 * (expected - before).abs().max().item()
    cublaslt.scaled_mm_add_(out, a, b_t, scale_a, scale_b)
    assert not cublaslt._unavailable and out.data_ptr() == pointer
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=tolerance)
    cublaslt.scaled_mm_add_(out, a, b_t, scale_a, scale_b)  # a second micro-batch's add sums again
    torch.testing.assert_close(out, 2 * expected - before, rtol=1e-5, atol=2 * tolerance)


class _WrongLt:
    """A binding whose GEMM adds the wrong thing (as a changed enum value or layout would)."""

    def __init__(self):
        self.calls = 0

    def scaled_mm_add_(self, out, a, b_t, scale_a, scale_b):
        self.calls += 1
        out.add_(1.0)


def test_a_binding_whose_sum_disagrees_falls_back_with_one_warning(monkeypatch):
    """The first call of a problem checks cuBLASLt's sum on a copy; a wrong one never reaches `out`: the op
    adds `_scaled_mm`'s product, says so once, and does not try cuBLASLt again for those dtypes."""
    wrong = _WrongLt()
    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    monkeypatch.setattr(cublaslt, "_library", lambda: wrong)
    monkeypatch.setattr(cublaslt, "_unavailable", {})
    out, a, b_t, scale_a, scale_b = _operands(32, 48, 64, E5M2, E4M3, "cpu")
    expected = _expected(out, a, b_t, scale_a, scale_b)
    with pytest.warns(UserWarning, match="does not run here"):
        cublaslt.scaled_mm_add_(out, a, b_t, scale_a, scale_b)
    assert torch.equal(out, expected) and wrong.calls == 1
    cublaslt.scaled_mm_add_(out, a, b_t, scale_a, scale_b)  # no second trial, no second warning
    assert wrong.calls == 1
    torch.testing.assert_close(out, 2 * expected - _operands(32, 48, 64, E5M2, E4M3, "cpu")[0])
