"""Gradient-accumulation fusion: under autocast a linear layer's fp32 weight gradient comes out of
its GEMM in fp32 (on CUDA) and otherwise equals autocast's F.linear: forward, input, weight and
bias gradients, eager and traced by torch.compile, in a whole model, and on a GPU more exactly.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.tensor_parallel import fp32_weight_grad
from megatron.core.tensor_parallel.fp32_weight_grad import linear
from tests.unit_tests.test_gpt_model import dlm_config, tiny_config, tokens

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 24, generator=generator).to(device).requires_grad_()
    weight = torch.randn(40, 24, generator=generator).to(device).requires_grad_()
    b = torch.randn(40, generator=generator).to(device).requires_grad_() if bias else None
    grad = torch.randn(3, 5, 40, generator=generator).to(device)
    return x, weight, b, grad


def _grads(function, x, weight, b, grad, autocast=True):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = function(x, weight, b)
    out.backward(grad)
    result = out.detach(), *(t.grad.clone() for t in (x, weight, b) if t is not None)
    for t in (x, weight, b):
        if t is not None:
            t.grad = None
    return result


@pytest.mark.parametrize("bias", [True, False])
def test_under_cpu_autocast_every_value_and_gradient_is_autocasts(bias):
    """On CPU the weight gradient is the bf16 product cast, as autocast's: equal to the bit. The bias
    gradient is summed into fp32 (autocast rounds the sum to bf16 first): within that rounding."""
    x, weight, b, grad = _inputs("cpu", bias)
    ours = _grads(linear, x, weight, b, grad)
    reference = _grads(F.linear, x, weight, b, grad)
    assert [t.dtype for t in ours] == [t.dtype for t in reference]
    assert ours[2].dtype == torch.float32
    for mine, theirs in zip(ours[:3], reference[:3]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(ours[3], grad.bfloat16().float().sum((0, 1)), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours[3], reference[3], rtol=8e-3, atol=0)


def test_without_autocast_or_without_the_flag_it_is_plain_linear():
    x, weight, b, _ = _inputs("cpu")
    assert linear(x, weight, b).grad_fn.name() == F.linear(x, weight, b).grad_fn.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "LinearFp32WeightGrad" in linear(x, weight, b).grad_fn.name()
        assert "LinearFp32WeightGrad" not in linear(x, weight, b, fp32_weight_grad=False).grad_fn.name()
        assert "LinearFp32WeightGrad" not in linear(x, weight.detach().bfloat16(), None).grad_fn.name()


def test_torch_compile_traces_it_and_gives_the_eager_gradients():
    x, weight, b, grad = _inputs("cpu")
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)
    for mine, theirs in zip(_grads(compiled, x, weight, b, grad), _grads(linear, x, weight, b, grad)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_bf16_model_trains_the_same_with_and_without_the_fusion():
    """Every parameter's gradient of a whole bf16 model (attention, MLP, untied output layer, biases)."""
    grads = []
    for fusion in (True, False):
        config = tiny_config(bf16=True, add_bias_linear=True, share_embeddings_and_output_weights=False,
                             gradient_accumulation_fusion=fusion)
        torch.manual_seed(0)
        model = GPTModel(config, dlm_config())
        model.compute_loss(tokens(), key=None).loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name].dtype == torch.float32
        exact = 0 if name.endswith("weight") else 8e-3  # biases: summed in fp32, not rounded to bf16 first
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=exact, atol=exact * 1e-3, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_the_weight_gradient_is_at_least_as_exact_as_autocasts(device):
    """Against fp32 arithmetic on the same bf16-rounded operands: on CUDA the GEMM's fp32 output is
    closer than autocast's bf16-rounded gradient; elsewhere it is the same."""
    x, weight, b, grad = _inputs(device)
    exact = grad.bfloat16().float().reshape(-1, 40).t() @ x.detach().bfloat16().float().reshape(-1, 24)
    ours = _grads(linear, x, weight, b, grad)[2]
    reference = _grads(F.linear, x, weight, b, grad)[2]
    our_error, their_error = (ours - exact).abs().max(), (reference - exact).abs().max()
    if device == "cuda":
        assert our_error < 1e-4 < their_error
    else:
        assert our_error == their_error


def test_matmul_fp32_off_cuda_is_the_cast_product():
    a, b = torch.randn(4, 3).bfloat16(), torch.randn(3, 5).bfloat16()
    assert torch.equal(fp32_weight_grad.matmul_fp32(a, b), (a @ b).float())


def test_only_the_gradients_asked_for_are_computed():
    """A frozen weight gets no gradient and an input that needs none gets none; the rest are unchanged."""
    x, weight, b, grad = _inputs("cpu")
    reference = _grads(linear, x, weight, b, grad)
    weight.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x.detach(), weight, b)
    out.backward(grad)
    assert weight.grad is None and torch.equal(b.grad, reference[3])
