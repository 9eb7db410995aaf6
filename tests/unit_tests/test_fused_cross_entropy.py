"""The fused loss's Triton kernel (fused_cross_entropy): the same losses, log-sum-exp and logits
gradient as the plain tensor math it replaces, and through linear_cross_entropy the same loss and
gradients as torch.compile's kernel. On a GPU the CUDA cases run the compiled kernel; on CPU, where
Triton is installed (the dev extras install it), the same cases run under Triton's interpreter."""

import pytest
import torch

from megatron.core.tensor_parallel import linear_cross_entropy as lce
from megatron.core.fusions import fused_cross_entropy as kernel
from megatron.core.fusions import triton_support
from megatron.core.models.difflm.diffusion import CorruptionKey
from tests.unit_tests.test_fused_swiglu import DEVICES

# Where there is a GPU, tests/conftest.py leaves the interpreter off and the CUDA cases run the kernel.


@pytest.fixture
def device(request, monkeypatch):
    # on CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
    monkeypatch.setattr(kernel, "BLOCK", 64)  # several steps per row, and a ragged last one
    return torch.device(request.param)


def rows(device, count=6, columns=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(count, columns, generator=generator) * 4).to(torch.bfloat16)
    logits[1] += 30.0  # a large offset: the online max must keep the sum finite
    targets = torch.randint(0, columns - 11, (count,), generator=generator)
    scale = torch.rand(count, generator=generator)
    scale[2] = 0.0  # a token with no loss weight
    return logits.to(device), targets.to(device), scale.to(device)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("padding", [0, 11])
def test_kernel_matches_the_tensor_math(device, padding):
    logits, targets, scale = rows(device)
    valid = logits.shape[1] - padding
    assert kernel.available(logits)
    expected = lce._softmax_loss_gradient(logits, targets, scale, valid)
    buffer = logits.clone()
    losses, lse, grad = kernel.softmax_loss_gradient_(buffer, targets, scale, valid)
    assert grad.data_ptr() == buffer.data_ptr(), "the gradient is written over the logits"
    torch.testing.assert_close(losses, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=1e-5)
    # bf16 gradients: one rounding step apart at most
    torch.testing.assert_close(grad.float(), expected[2].float(), rtol=0, atol=2 ** -8)
    assert not grad[:, valid:].any(), "no gradient into the vocabulary padding"
    assert not grad[2].any(), "a token with no weight has no gradient"
    assert abs(grad[0].float().sum().item()) < 0.02, "softmax - one-hot sums to zero"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_linear_cross_entropy_same_as_the_compiled_kernel(device, monkeypatch):
    """Both fused kernels inside the chunked output layer (bf16 GEMMs over fp32 parameters), chosen by
    linear_cross_entropy's `triton_kernel` (DLMConfig.loss_kernel)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 32, generator=generator).to(device)
    weight = (torch.randn(320, 32, generator=generator) * 0.5).to(device)
    targets = torch.randint(0, 300, (13,), generator=generator).to(device)
    loss_weights = torch.rand(13, generator=generator).to(device)
    calls = []
    real = kernel.softmax_loss_gradient_
    monkeypatch.setattr(kernel, "softmax_loss_gradient_", lambda *args: calls.append(1) or real(*args))
    results = {}
    for triton in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses, total = lce.linear_cross_entropy(h, w, targets, loss_weights, unpadded_vocab_size=300,
                                                 compute_dtype=torch.bfloat16, chunk_size=5, compiled=True,
                                                 triton_kernel=triton)
        (2.0 * total).backward()
        results[triton] = (losses, total, h.grad, w.grad)
        assert len(calls) == 3, "three chunks of at most 5 tokens went through the Triton kernel, none after"
    for got, want in zip(results[True][:2], results[False][:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(results[True][2:], results[False][2:]):
        # the bf16 logits gradients may round apart by one step, and a CPU bf16 GEMM rounds its product
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * want.abs().max().item())


@pytest.mark.parametrize("loss_kernel, triton", [("triton", True), ("inductor", False)])
def test_the_loss_kernel_of_the_dlm_config_reaches_the_chunked_loss(loss_kernel, triton, monkeypatch):
    """DLMConfig.loss_kernel (--difflm-loss-kernel) is passed down to linear_cross_entropy as `triton_kernel`."""
    from megatron.core.models.difflm import output_layer
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

    seen, real = [], output_layer.linear_cross_entropy
    monkeypatch.setattr(output_layer, "linear_cross_entropy",
                        lambda *a, **k: seen.append(k["triton_kernel"]) or real(*a, **k))
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64,
                               attention_backend="math")
    dlm = DLMConfig(mask_token_id=63, masked_only_loss=True, compile_loss=True, loss_kernel=loss_kernel)
    model = GPTModel(config, dlm)
    key = CorruptionKey.for_batch(0, iteration=1, global_batch_size=2, first_sample_index=0, batch_size=2)
    model.compute_loss(torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(0)), key=key)
    assert seen == [triton]


def test_a_loss_kernel_outside_the_choices_is_refused():
    from megatron.core.transformer.transformer_config import DLMConfig

    with pytest.raises(ValueError, match="loss_kernel='cuda' is not one of"):
        DLMConfig(mask_token_id=63, loss_kernel="cuda").validate()


def test_bad_logits_are_refused():
    assert not kernel.available(torch.zeros(2, 8)), "fp32 logits keep torch.compile's kernel"
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.softmax_loss_gradient_(torch.zeros(4, 8, dtype=torch.bfloat16).t(), torch.zeros(8, dtype=torch.long),
                                      torch.ones(8), 4)
    with pytest.raises(ValueError, match="valid_columns"):
        kernel.softmax_loss_gradient_(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long),
                                      torch.ones(4), 0)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.5, 3.0, 0.0])
def test_scale_unless_one_multiplies_in_place(device, dtype, factor, monkeypatch):
    """The grid-stride loop covers every element (several steps per program, a ragged last block) and
    gives the multiply's bits in fp32 (the loss's gradients); a factor of 1 leaves the tensor as it
    was. (Triton's interpreter rounds to bf16 towards zero, the GPU to nearest: bf16 within an ulp.)"""
    monkeypatch.setattr(kernel, "SCALE_BLOCK", 16)
    monkeypatch.setattr(kernel, "SCALE_PROGRAMS", 3)
    x = torch.randn(7, 31, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    expected = x * torch.tensor(factor, device=device)
    out = kernel.scale_unless_one_(x, torch.tensor(factor, device=device))
    assert out is x
    if dtype == torch.float32 or factor == 1.0:
        assert torch.equal(x, expected)
    else:
        torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_scale_unless_one_never_waits_for_the_device(device, monkeypatch):
    """The factor is read by the kernel, never by the host: the training loop's backward keeps its
    launch queue full. On CUDA, torch's sync debug mode raises at any host synchronisation."""
    x, factor = torch.ones(1000, device=device), torch.tensor(2.0, device=device)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("the factor was read on the host"))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        kernel.scale_unless_one_(x, factor)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(x.cpu(), torch.full((1000,), 2.0))


def test_scale_unless_one_without_the_kernel_multiplies_unless_one(monkeypatch):
    """Where the kernel cannot run (no Triton, or a CPU tensor without the interpreter) the multiply
    runs, skipped on CPU for a factor of exactly 1."""
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    x = torch.full((5,), 3.0)
    kernel.scale_unless_one_(x, torch.tensor(1.0))
    kernel.scale_unless_one_(x, torch.tensor(0.5))
    assert torch.equal(x, torch.full((5,), 1.5))
