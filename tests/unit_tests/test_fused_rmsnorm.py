"""RMSNorm's Triton kernels (fused_rmsnorm): the tensor math's output and gradients (the input's and the
weight's, made in one backward pass), in the model's norms when `rmsnorm_fusion` is on, traced whole by
torch.compile. On CPU, where Triton is installed, the cases run under Triton's interpreter."""

import pytest
import torch

from megatron.core.fusions import fused_rmsnorm as kernel
from megatron.core.fusions import triton_support
from megatron.core.transformer.norms import RMSNorm, build_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_fused_swiglu import DEVICES  # the interpreter on CPU, the kernels on CUDA


@pytest.fixture
def device(request, monkeypatch):
    # small tiles and few programs: several tiles a band, a ragged last tile and band
    monkeypatch.setattr(kernel, "TILE", 512)
    monkeypatch.setattr(kernel, "PROGRAMS", 3)
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    return torch.device(request.param)


def reference(x, scale, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3, 150), (37, 2, 4, 16)])  # a hidden width; per-head (qk-norm) rows
def test_kernels_match_the_tensor_math(device, dtype, shape):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 3).to(device=device, dtype=dtype).requires_grad_()
    scale = (torch.rand(shape[-1], generator=generator) + 0.5).to(device).requires_grad_()
    grad = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    out = kernel.rms_norm(x, scale, 1e-6)
    dx, dscale = torch.autograd.grad(out, (x, scale), grad)
    x32, scale32 = x.detach().float().requires_grad_(), scale.detach().requires_grad_()
    expected = reference(x32, scale32, 1e-6)  # fp32 arithmetic: the kernels round once, at the end
    expected_dx, expected_dscale = torch.autograd.grad(expected, (x32, scale32), grad.float())
    assert out.dtype == dtype and dx.dtype == dtype and dscale.dtype == torch.float32
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(dx.float(), expected_dx, **tolerance)
    torch.testing.assert_close(dscale, expected_dscale, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_an_empty_batch_and_a_wrong_scale(device):
    empty = torch.zeros(0, 3, 16, device=device, requires_grad=True)
    scale = torch.ones(16, device=device, requires_grad=True)
    out = kernel.rms_norm(empty, scale, 1e-6)
    dx, dscale = torch.autograd.grad(out.sum(), (empty, scale))
    assert out.shape == (0, 3, 16) and dx.shape == (0, 3, 16) and torch.equal(dscale, torch.zeros(16, device=device))
    with pytest.raises(ValueError, match="scale of shape"):
        kernel.rms_norm(torch.zeros(2, 8, device=device), torch.ones(4, device=device), 1e-6)


def norm_config(fusion, zero_centered=False):
    return TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=2, normalization="RMSNorm",
                             rmsnorm_fusion=fusion, layernorm_zero_centered_gamma=zero_centered)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_the_norm_uses_the_kernels_with_the_fusion_and_trains_the_same(device, zero_centered, monkeypatch):
    calls = []
    original = kernel.rms_norm
    monkeypatch.setattr(kernel, "rms_norm", lambda x, *a: calls.append(tuple(x.shape)) or original(x, *a))
    hidden = torch.randn(5, 2, 24, generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for fusion in (True, False):
        norm = build_norm(norm_config(fusion, zero_centered), 24).to(device)
        with torch.no_grad():
            norm.weight.add_(torch.linspace(-0.3, 0.3, 24, device=device))
        x = hidden.clone().requires_grad_()
        out = norm(x)
        out.square().sum().backward()
        results.append((out, x.grad, norm.weight.grad))
    assert isinstance(norm, RMSNorm) and calls == [(5, 2, 24)], "only the fused norm calls the kernels"
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_the_fusion_needs_rmsnorm():
    with pytest.raises(ValueError, match="rmsnorm_fusion"):
        TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=2, normalization="LayerNorm",
                          rmsnorm_fusion=True).validate()


@pytest.mark.gpu
def test_torch_compile_traces_the_kernels_whole():
    """fullgraph=True fails on any graph break: the ops must be traced into a compiled norm."""
    hidden = torch.randn(64, 2, 24, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    fused, plain = (build_norm(norm_config(fusion), 24).cuda() for fusion in (True, False))
    fused.compile(fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [norm(hidden.bfloat16()) for norm in (fused, plain)]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2)


def test_the_flag_turns_the_fusion_on_for_rmsnorm_only(capsys):
    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args, transformer_config_from_args
    from tests.unit_tests.test_bad_inputs_training import TINY

    def config(extra):
        return transformer_config_from_args(parse_args(TINY + extra, add_difflm_args, world_size=1))

    assert not config(["--normalization", "RMSNorm"]).rmsnorm_fusion
    assert config(["--normalization", "RMSNorm", "--rmsnorm-fusion"]).rmsnorm_fusion
    with pytest.raises(SystemExit):
        config(["--rmsnorm-fusion"])
    assert "rmsnorm_fusion needs normalization='RMSNorm'" in capsys.readouterr().err
