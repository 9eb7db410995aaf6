"""The float8 layers' weight gradients added into `.grad` by their GEMM across micro-batches
(triton_float8_matmul.accumulate_float8_matmul_, reached from float8_matmul.float8_linear inside
fp32_weight_grad.accumulating_into_grad).

Each test fails if its part broke: the kernel's sum (a wrong tile, scale, layout or mask is far off),
its storage (a copy instead of `.grad` itself), the layers' wiring (the op not called, called for the
first micro-batch, or a sum that differs from autograd's), in Megatron's default configuration and the
Llama style, DLM and AR."""

import re

import pytest
import torch

from megatron.core import triton_support
from megatron.core.tensor_parallel import float8_matmul, fp32_weight_grad, triton_float8_matmul
from megatron.core.tensor_parallel.weight_copies import WeightCopies
from megatron.core.transformer.compilation import compile_transformer_layers
from tests.unit_tests.test_gpt_model import tokens
from tests.unit_tests.test_weight_copies import STYLES, build

MODES = ("difflm-noshift", "vanilla")
MICRO_BATCHES = 3
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA case (the GPU machine runs it)")
INTERPRETER = pytest.mark.skipif(not triton_support.interpreting(),
                                 reason="CPU tensors under Triton's interpreter (CPU machines run it)")


def _operands(m: int, n: int, k: int, device: str, a_dtype=torch.float8_e5m2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=generator) * 4).to(a_dtype).to(device)
    b = (torch.randn(n, k, generator=generator) * 4).to(torch.float8_e4m3fn).to(device)
    out = torch.randn(m, n, generator=generator).to(device)
    scales = torch.tensor(0.37, device=device), torch.tensor(1.9, device=device)
    return out, a, b, scales


def _exact(out, a, b, scales):
    """out + (a @ b^T) * scale_a * scale_b in fp64 (float8 values are exact there)."""
    product = a.double() @ b.double().t()
    return out.double() + product * (scales[0].double() * scales[1].double())


@INTERPRETER
@pytest.mark.parametrize("shape", [(48, 80, 96), (48, 80, 80), (96, 32, 64)], ids=["partial-tiles", "uneven-k",
                                                                                    "groups"])
@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])
def test_the_kernel_adds_the_scaled_product_into_out(shape, a_dtype, monkeypatch):
    """Under Triton's interpreter with its 32 x 32 x 32 tiles: partial tiles in both dimensions, an inner
    dimension that is not a multiple of the block, several groups of tile rows."""
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    out, a, b, scales = _operands(*shape, "cpu", a_dtype)
    assert triton_float8_matmul.kernel_runs_on(out)
    expected, pointer = _exact(out, a, b, scales), out.data_ptr()
    triton_float8_matmul.accumulate_float8_matmul_(out, a, b, *scales)
    assert out.data_ptr() == pointer
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-4)


def test_without_the_kernel_it_adds_scaled_mms_product():
    out, a, b, scales = _operands(32, 48, 64, "cpu")
    assert not triton_float8_matmul.kernel_runs_on(out)  # a CPU tensor outside an allowing test
    expected = out + torch._scaled_mm(a, b.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.float32)
    triton_float8_matmul.accumulate_float8_matmul_(out, a, b, *scales)
    assert torch.equal(out, expected)


@CUDA
@pytest.mark.parametrize("shape", [(256, 384, 4096), (272, 144, 1040)], ids=["tiles", "partial"])
def test_on_cuda_the_kernel_sums_as_closely_as_scaled_mm(shape):
    """The autotuned kernel itself against cuBLAS's float8 GEMM without fast accumulation: both as near
    the exact sum (a fast-accumulating kernel drifts at this depth)."""
    out, a, b, scales = _operands(*shape, "cuda")
    exact = _exact(out, a, b, scales)
    cublas = out + torch._scaled_mm(a, b.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.float32)
    triton_float8_matmul._launch(out, a, b, *scales)
    ours, theirs = (out.double() - exact).abs().max(), (cublas.double() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-5 * exact.abs().max(), (ours, theirs)  # fast accumulation drifts past it


@CUDA
def test_on_cuda_the_op_chooses_a_way_once_and_adds_the_product(monkeypatch):
    monkeypatch.setattr(triton_float8_matmul, "CHOICES", {})
    out, a, b, scales = _operands(512, 256, 2048, "cuda")
    expected = _exact(out, a, b, scales)
    triton_float8_matmul.accumulate_float8_matmul_(out, a, b, *scales)
    assert list(triton_float8_matmul.CHOICES) == [(512, 256, 2048, out.device.index)]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


def _accumulate(style: str, mode: str, in_place: bool, compiled: bool = False) -> dict:
    model = build(style, mode)
    if compiled:
        compile_transformer_layers(model)
    copies = WeightCopies(model, torch.bfloat16, "hybrid")
    assert copies.float8_layers == 2 * 4  # two layers of four linears
    copies.refresh()
    with fp32_weight_grad.accumulating_into_grad(in_place), torch.autocast("cpu", dtype=torch.bfloat16):
        for index in range(MICRO_BATCHES):
            torch.manual_seed(100 + index)  # the same corruption for both runs
            model.compute_loss(tokens(seed=index), key=None).loss_sum.backward()
    return {name: param.grad for name, param in model.named_parameters()}


def _weight_grads(grads: dict) -> set:
    return {grad.data_ptr() for name, grad in grads.items() if name.startswith("decoder") and "linear" in name
            and name.endswith("weight")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("style", STYLES)
def test_float8_layers_add_their_weight_gradients_in_place_to_the_bit(style, mode, monkeypatch):
    """Every micro-batch after the first adds each float8 layer's weight gradient through the op (here
    `_scaled_mm`'s product added, the kernel being tested above), the same sums as autograd's."""
    calls, original = [], float8_matmul.accumulate_float8_matmul_
    monkeypatch.setattr(float8_matmul, "accumulate_float8_matmul_",
                        lambda out, *args: calls.append(out.data_ptr()) or original(out, *args))
    reference = _accumulate(style, mode, in_place=False)
    assert calls == []
    ours = _accumulate(style, mode, in_place=True)
    assert len(calls) == 2 * 4 * (MICRO_BATCHES - 1) and set(calls) == _weight_grads(ours)  # into `.grad`
    assert reference.keys() == ours.keys()
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


def test_a_compiled_layer_adds_into_the_gradient_itself():
    """Under torch.compile the backward calls the op on the gradient (no copy written back), and the
    gradients are those of the compiled layers without it."""
    from torch._inductor.utils import run_and_get_code

    (reference, reference_code), (ours, code) = (run_and_get_code(_accumulate, "llama", "difflm-noshift", in_place,
                                                                  compiled=True) for in_place in (False, True))
    assert not any("megadlms.accumulate_float8_matmul_" in source for source in reference_code)
    # called on the backward graph's input, the gradient itself, not on a buffer copied back afterwards
    assert any(re.search(r"megadlms\.accumulate_float8_matmul_\.default\(primals_\d+,", source) for source in code)
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=0, msg=name)


@INTERPRETER
@pytest.mark.parametrize("kernel_faster", [True, False])
def test_the_op_keeps_the_faster_way_for_each_shape(kernel_faster, monkeypatch):
    """The first call of a shape times both ways (a stand-in timer here: the kernel 1 ms, cuBLAS's GEMM and
    the add 2 ms, or the other way round), keeps the faster without leaving either's sum in `out`, and does
    not time the shape again."""
    import triton.testing

    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    monkeypatch.setattr(triton_float8_matmul, "CHOICES", {})
    timed = []

    def fake_bench(function, return_mode):
        function()  # each way adds into `out`: the op must restore it
        timed.append(1)
        return (1.0 if kernel_faster else 3.0) if len(timed) % 2 else 2.0
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    out, a, b, scales = _operands(32, 48, 64, "cpu")
    before = out.clone()
    for _ in range(2):
        assert triton_float8_matmul._kernel_wins(out, a, b, *scales) is kernel_faster
        assert torch.equal(out, before)
    assert len(timed) == 2 and list(triton_float8_matmul.CHOICES) == [(32, 48, 64, None)]
    monkeypatch.setattr(triton_float8_matmul, "_capturing", lambda out: True)
    other = _operands(64, 48, 64, "cpu")
    assert not triton_float8_matmul._kernel_wins(*other[:3], *other[3])  # inside a capture: no timing
    assert len(timed) == 2 and len(triton_float8_matmul.CHOICES) == 1  # nor a choice kept


@CUDA
def test_deterministic_mode_adds_through_cublas():
    out, a, b, scales = _operands(256, 384, 1024, "cuda")
    torch.use_deterministic_algorithms(True)
    try:
        assert not triton_float8_matmul.uses_kernel(out, a, b, *scales)
    finally:
        torch.use_deterministic_algorithms(False)
    assert triton_float8_matmul.kernel_runs_on(out)


def test_a_kernel_that_does_not_build_leaves_cublas_with_a_warning(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    monkeypatch.setattr(triton_float8_matmul, "CHOICES", {})
    monkeypatch.setattr(triton.testing, "do_bench", lambda function, return_mode: function() or 1.0)

    def broken(*args):
        raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(triton_float8_matmul, "_launch", broken)
    out, a, b, scales = _operands(32, 48, 64, "cpu")
    before = out.clone()
    with pytest.warns(UserWarning, match="kernel did not run .* adding cuBLAS's product instead"):
        assert not triton_float8_matmul._kernel_wins(out, a, b, *scales)
    assert torch.equal(out, before)


@INTERPRETER
def test_operands_a_descriptor_cannot_read_go_through_cublas(monkeypatch):
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    out, a, b, scales = _operands(32, 48, 64, "cpu")
    assert triton_float8_matmul.uses_kernel(out, a, b, *scales)
    strided = torch.empty(48, 128, dtype=b.dtype)[:, :64]
    strided.copy_(b)
    assert not triton_float8_matmul.uses_kernel(out, a, strided, *scales)  # rows not contiguous
    expected = _exact(out, a, b, scales)
    triton_float8_matmul.accumulate_float8_matmul_(out, a, strided, *scales)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-4)
