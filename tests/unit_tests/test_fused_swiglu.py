"""SwiGLU's Triton kernels (fused_swiglu): the same output and input gradient as the tensor math, in the
MLP when the fusion is on, traced whole by torch.compile. On a GPU the CUDA cases run the compiled kernels;
on CPU, where Triton is installed (the dev extras install it), the same cases run under Triton's interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.fusions import triton_support
from megatron.core.fusions import fused_swiglu as kernel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
CPU = pytest.mark.skipif(torch.cuda.is_available() or not triton_support.HAS_TRITON,
                         reason="the CUDA cases run the kernels" if triton_support.HAS_TRITON
                         else "Triton is not installed")
DEVICES = [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=pytest.mark.gpu)]
"""A Triton kernel's test cases: under Triton's interpreter on a CPU, the kernel itself on a GPU (the other
kernels' tests use them too)."""


@pytest.fixture
def device(request, monkeypatch):
    # on CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
    monkeypatch.setattr(kernel, "BLOCK", 64)  # several programs per row, and a ragged last one
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    return torch.device(request.param)


def fc1_output(device, dtype, shape=(5, 3, 2 * 150), seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    return x.to(device=device, dtype=dtype).requires_grad_()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_tensor_math(device, dtype):
    x = fc1_output(device, dtype)
    assert kernel.available(x)
    out = kernel.swiglu(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    (dx,) = torch.autograd.grad(out, x, grad)
    # the reference in fp32 arithmetic: the kernels round once, at the end
    x32 = x.detach().float().requires_grad_()
    expected = kernel.reference(x32)
    (expected_dx,) = torch.autograd.grad(expected, x32, grad.float())
    assert out.shape == (5, 3, 150) and out.dtype == dtype and dx.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(dx.float(), expected_dx, **tolerance)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_non_contiguous_gradient_and_an_empty_batch(device):
    x = fc1_output(device, torch.float32, shape=(4, 2 * 70))
    out = kernel.swiglu(x)
    grad = torch.randn(70, 4, generator=torch.Generator().manual_seed(3)).to(device).t()  # a transposed view
    (dx,) = torch.autograd.grad(out, x, grad)
    x32 = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(kernel.reference(x32), x32, grad)
    torch.testing.assert_close(dx, expected, rtol=1e-5, atol=1e-5)
    empty = fc1_output(device, torch.float32, shape=(0, 2 * 70))
    assert kernel.swiglu(empty).shape == (0, 70)


def test_an_odd_width_is_refused():
    with pytest.raises(ValueError, match="even last dimension"):
        kernel.swiglu(torch.zeros(2, 7))


def mlp(fusion, device, bias=False):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96,
                               gated_linear_unit=True, activation="silu", add_bias_linear=bias,
                               bias_swiglu_fusion=fusion)
    return MLP(config).to(device)


def forward_backward(module, hidden):
    hidden = hidden.detach().requires_grad_()
    out = module(hidden)
    out.square().sum().backward()
    parameters = module.named_parameters() if isinstance(module, torch.nn.Module) else []  # or a function
    return out, hidden.grad, {name: p.grad for name, p in parameters}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_the_mlp_uses_the_kernels_and_trains_the_same(device, bias, monkeypatch):
    calls = []
    original = kernel.swiglu
    monkeypatch.setattr(kernel, "swiglu", lambda x: calls.append(x.shape) or original(x))
    hidden = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(4)).to(device)
    fused = forward_backward(mlp(True, device, bias), hidden)
    assert calls == [(6, 2, 192)], "the fused MLP must call the kernels"
    plain = forward_backward(mlp(False, device, bias), hidden)
    assert calls == [(6, 2, 192)], "--no-bias-swiglu-fusion must keep the tensor math"
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    for name, grad in plain[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_the_experts_use_the_kernels_and_train_the_same(device, monkeypatch):
    """The grouped experts share the MLP's activation: [gate; up] rows per expert, empty experts included."""
    from megatron.core.transformer.moe.config import MoEConfig
    from megatron.core.transformer.moe.experts import GroupedExperts

    calls = []
    original = kernel.swiglu
    monkeypatch.setattr(kernel, "swiglu", lambda x: calls.append(x.shape) or original(x))
    tokens = torch.randn(9, 16, generator=torch.Generator().manual_seed(6)).to(device)
    counts = torch.tensor([4, 0, 5], device=device)  # the middle expert gets no token
    results = []
    for fusion in (True, False):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24,
                                   gated_linear_unit=True, activation="silu", bias_swiglu_fusion=fusion,
                                   moe=MoEConfig(num_experts=3, router_topk=1))
        experts = GroupedExperts(config).to(device)
        out, grad, _ = forward_backward(lambda x: experts(x, counts), tokens)
        results.append((out, grad, experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad))
    assert calls == [(9, 48)], "only the fused experts call the kernels"
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_torch_compile_traces_the_kernels_whole():
    """fullgraph=True fails on any graph break: the ops must be traced into the compiled MLP."""
    hidden = torch.randn(64, 2, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    compiled = mlp(True, "cuda")
    compiled.compile(fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = forward_backward(compiled, hidden)
        plain = forward_backward(mlp(False, "cuda"), hidden)
    torch.testing.assert_close(fused[0].float(), plain[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused[1], plain[1], rtol=2e-2, atol=2e-2)


def test_the_flag_turns_the_fusion_off():
    from megatron.training.arguments import parse_args, transformer_config_from_args
    from custom_args.difflm import add_difflm_args
    from tests.unit_tests.test_bad_inputs_training import TINY

    def config(extra):
        return transformer_config_from_args(parse_args(TINY + ["--swiglu"] + extra, add_difflm_args, world_size=1))

    assert config([]).bias_swiglu_fusion
    assert not config(["--no-bias-swiglu-fusion"]).bias_swiglu_fusion



def test_a_cpu_model_never_registers_the_ops():
    """Registering the ops imports Triton and part of Inductor (about 2 s of every process's start, a CLI
    check or a generation included): a CPU process that builds the fused MLP and runs it must not."""
    code = ("import sys, torch; from tests.unit_tests.test_fused_swiglu import mlp; "
            "mlp(True, 'cpu')(torch.randn(2, 1, 32)).sum().backward(); "
            "print(sorted(m for m in ('torch._inductor', 'triton') if m in sys.modules))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(env, CUDA_VISIBLE_DEVICES=""), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
