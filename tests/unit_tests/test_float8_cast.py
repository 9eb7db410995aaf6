"""Delayed scaling's one-pass float8 cast (fused_float8_cast.py, reached through float8_matmul's casts
where the scale is given: the float8 linears' forward and backward under --fp8-recipe delayed).

Each test fails if its part broke: a wrong tile offset, mask, scale, saturation or transposition writes
other bytes than torch's cast; a wrong or missing atomic returns another amax; the layers not calling
the kernel with a given scale (or calling it without one), or recording another amax than its; on CUDA,
a rounding other than torch's, or a graph break where a compiled function traces the op.

Triton's interpreter rounds float8 its own way (not to nearest, and without carrying into the exponent),
so on CPU the inputs lie on the float8 grid once scaled, where the cast is exact; the rounding itself is
checked on CUDA against torch's cast, bit for bit, on random values."""

import pytest
import torch

from megatron.core.fusions import triton_support
from megatron.core.fp8 import float8_matmul
from megatron.core.fusions import fused_float8_cast
from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, DelayedScales
from megatron.core.fp8.float8_scaling import DelayedScaling

DTYPES = {"e4m3": FORWARD_DTYPE, "e5m2": GRADIENT_DTYPES["hybrid"]}
INTERPRETER = pytest.mark.skipif(not (triton_support.HAS_TRITON and triton_support.interpreting()),
                                 reason="CPU tensors under Triton's interpreter (CPU machines run it)")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _on_grid(rows: int, cols: int, dtype: torch.dtype, scale: float, seed: int = 0) -> torch.Tensor:
    """bf16 values that land on `dtype`'s normal numbers once multiplied by `scale` (a power of two), a few
    far past its largest (the cast saturates them)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=generator, dtype=torch.uint8)
    values = codes.view(dtype).float()
    tiny = torch.finfo(dtype).tiny
    values = torch.where(values.isfinite() & (values.abs() >= tiny), values, torch.full_like(values, tiny))
    values[::7, ::5] = 1e9  # saturates
    values[1::11, 2::3] *= -1e9
    return (values / scale).to(torch.bfloat16)


def _check_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, expected: torch.Tensor) -> None:
    rows, columns, amax = fused_float8_cast.cast_both_layouts(x, scale, dtype)
    assert rows.dtype == columns.dtype == dtype and columns.is_contiguous()
    assert torch.equal(_bytes(rows), _bytes(expected))
    assert torch.equal(_bytes(columns), _bytes(expected.t().contiguous()))
    assert amax.dtype == torch.float32 and torch.equal(amax, x.abs().max().float())


@INTERPRETER
@pytest.mark.parametrize("shape", [(40, 56), (32, 48), (17, 33)], ids=["partial-tiles", "whole-tiles", "odd"])
@pytest.mark.parametrize("name", DTYPES)
def test_the_kernel_writes_both_layouts_of_torchs_cast_and_its_amax(shape, name, monkeypatch):
    """Under the interpreter's 16 x 16 tiles: partial tiles in both dimensions, saturation, the scale, and
    the tensor's amax (the largest of its tiles')."""
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    dtype, scale = DTYPES[name], torch.tensor(8.0)
    x = _on_grid(*shape, dtype, scale.item())
    assert fused_float8_cast.available(x) and not fused_float8_cast.available(x.t())  # contiguous only
    _check_cast(x, scale, dtype, float8_matmul.scaled_cast(x, scale, dtype))


def _layer(bias: bool):
    from megatron.core.fp8.float8_copy import Float8Copy, cast_float8

    weight = torch.nn.Parameter(_on_grid(32, 48, FORWARD_DTYPE, 1.0).float().clamp(-448, 448))
    copy = Float8Copy(torch.empty(32, 48, dtype=FORWARD_DTYPE), torch.empty(48, 32, dtype=FORWARD_DTYPE),
                      torch.ones(()), GRADIENT_DTYPES["hybrid"])
    cast_float8([copy], [weight])
    return weight, copy, (torch.nn.Parameter(torch.randn(32)) if bias else None)


@INTERPRETER
@pytest.mark.parametrize("bias", [True, False], ids=["megatron-bias", "llama-no-bias"])
def test_a_delayed_float8_linear_casts_through_the_kernel(bias, monkeypatch):
    """With given scales the forward casts the input through the kernel and the backward the output
    gradient; the layer's output, gradients and recorded amaxes are those of the tensor-math casts (exact
    here: every operand lies on the grid once scaled). Without a scale (the tensorwise recipe, or delayed
    scaling's first iteration) the kernel is not called, and the amaxes are recorded all the same."""
    weight, copy, bias_parameter = _layer(bias)
    x = _on_grid(64, 48, FORWARD_DTYPE, 2.0, seed=1).clamp(-224, 224).requires_grad_()
    grad_output = _on_grid(64, 32, GRADIENT_DTYPES["hybrid"], 4.0, seed=2).clamp(-14336, 14336)

    def run(ready: bool):
        amax = torch.zeros(2)
        delayed = DelayedScales(torch.tensor([2.0, 4.0]), amax, ready, DelayedScaling._gradient_amax_leaf(amax[1:]))
        for tensor in (weight, x, bias_parameter):
            if tensor is not None:
                tensor.grad = None
        out = float8_matmul.float8_linear(x, weight, bias_parameter, copy._replace(delayed=delayed), torch.bfloat16)
        out.backward(grad_output)
        return [out, amax] + [t.grad for t in (weight, x, bias_parameter) if t is not None]
    reference = run(ready=True)
    calls, original = [], fused_float8_cast.cast_both_layouts
    monkeypatch.setattr(fused_float8_cast, "cast_both_layouts", lambda *args: calls.append(args[2]) or original(*args))
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    ours = run(ready=True)
    assert calls == [FORWARD_DTYPE, GRADIENT_DTYPES["hybrid"]]
    for mine, theirs in zip(ours, reference):
        assert torch.equal(mine, theirs)
    expected_amax = torch.stack([x.detach().to(torch.bfloat16).abs().max().float(), grad_output.abs().max().float()])
    assert torch.equal(ours[1], expected_amax)
    first_iteration = run(ready=False)
    assert len(calls) == 2 and torch.equal(first_iteration[1], expected_amax)  # tensor math, amaxes recorded


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (272, 1040), (8192, 14336)], ids=["square", "partial", "fc2"])
@pytest.mark.parametrize("name", DTYPES)
def test_on_cuda_the_kernel_rounds_as_torchs_cast(shape, name):
    """Random values (most between two float8 numbers), rounded by the hardware's conversion: the bytes of
    torch's cast, compiled as the layers compile it and eager, and the amax exact."""
    dtype = DTYPES[name]
    x = (torch.randn(*shape, device="cuda") * 3).to(torch.bfloat16)
    x[0, :7] = torch.tensor([1e4, -1e4, 0.0, -0.0, 1e-30, 31.875, -6.25])
    scale = torch.tensor(37.5, device="cuda")  # saturates the largest
    _check_cast(x, scale, dtype, torch.compile(float8_matmul.scaled_cast)(x, scale, dtype))
    _check_cast(x, scale, dtype, float8_matmul.scaled_cast(x, scale, dtype))


@pytest.mark.gpu
def test_on_cuda_a_compiled_function_traces_the_op():
    """Compiled code calls the kernel inside its graph (no graph break) and returns what eager code does."""
    x = torch.randn(1024, 768, device="cuda").to(torch.bfloat16)
    fused_float8_cast.register_for(x)
    scale = torch.tensor(40.0, device="cuda")
    compiled = torch.compile(float8_matmul.cast_both_layouts, fullgraph=True)
    ours, eager = compiled(x, FORWARD_DTYPE, scale), float8_matmul.cast_both_layouts(x, FORWARD_DTYPE, scale)
    for mine, theirs in zip(ours, eager):
        assert torch.equal(_bytes(mine) if mine.dtype == FORWARD_DTYPE else mine,
                           _bytes(theirs) if theirs.dtype == FORWARD_DTYPE else theirs)
    assert ours[3] == x.abs().max().float()
