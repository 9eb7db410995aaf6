"""--fp8-output-layer: the chunked output layer's logits and input-gradient GEMMs in float8
(fp8/float8_matmul.py): the casts, the scaled GEMMs against the same math on the
dequantised operands, the loss and gradients against the compute-dtype GEMMs, and the flags."""

import pytest
import torch

from megatron.core.fp8 import float8_matmul as f8
from megatron.core.tensor_parallel import linear_cross_entropy as lce
from tests.unit_tests.test_bad_inputs_training import TINY, parse_error


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dtype,mantissa_bits", [(torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)])
def test_the_cast_puts_the_amax_on_the_largest_value(dtype, mantissa_bits):
    x = rand(40, 32, scale=1e-3)
    x8, inverse = f8.to_float8(x, dtype)
    assert x8.dtype == dtype and x8.float().abs().max() == torch.finfo(dtype).max
    back = x8.float() * inverse
    large = x.abs() > x.abs().max() / 50
    assert ((back - x).abs() / x.abs())[large].max() <= 2.0 ** -(mantissa_bits + 1)


def dequantised(x8, inverse):
    return x8.float() * inverse


@pytest.mark.parametrize("rows", [16, 13, 1])  # padded to a multiple of 16 inside
def test_the_scaled_gemms_are_the_products_of_the_dequantised_operands(rows):
    weight = f8.Float8Weight.of(rand(48, 32, seed=1))
    hidden = rand(rows, 32, seed=2)
    hidden8, inverse = f8.to_float8(hidden, f8.FORWARD_DTYPE)
    expected = dequantised(hidden8, inverse) @ dequantised(weight.rows, weight.inverse_scale).t()
    got = f8.logits(hidden, weight, torch.float32)
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = rand(rows, 48, seed=3, scale=1e-2)
    grad8, grad_inverse = f8.to_float8(grad, torch.float8_e5m2)
    expected = dequantised(grad8, grad_inverse) @ dequantised(weight.rows, weight.inverse_scale)
    torch.testing.assert_close(f8.input_gradient(grad, weight, "hybrid"), expected, rtol=1e-5, atol=1e-5)


def test_a_weight_off_the_alignment_is_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        f8.Float8Weight.of(torch.zeros(40, 24))


def loss_and_grads(fp8, compiled=False, per_token=False, compute_dtype=torch.float32):
    hidden, weight = rand(45, 64, seed=4).requires_grad_(), rand(256, 64, seed=5, scale=0.1).requires_grad_()
    targets = torch.randint(0, 250, (45,), generator=torch.Generator().manual_seed(6))
    weights = torch.rand(45, generator=torch.Generator().manual_seed(7))
    losses, total = lce.linear_cross_entropy(hidden, weight, targets, weights, unpadded_vocab_size=250,
                                             compute_dtype=compute_dtype, chunk_size=16, compiled=compiled, fp8=fp8)
    (losses * weights).sum().backward() if per_token else total.backward()
    return losses.detach(), hidden.grad, weight.grad


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_the_loss_and_gradients_stay_near_the_compute_dtype_gemms(fmt):
    reference, got = loss_and_grads(None), loss_and_grads(fmt)
    assert relative(got[0], reference[0]) < 0.02, "losses"
    assert relative(got[2], reference[2]) < 0.02, "weight gradient (its GEMM stays in the compute dtype)"
    # the logits gradient in e5m2 (hybrid) keeps 2 mantissa bits, in e4m3 three
    assert relative(got[1], reference[1]) < (0.12 if fmt == "hybrid" else 0.06), "input gradient"
    assert relative(got[1], reference[1]) > 1e-4, "the input gradient's GEMM really ran in float8"


def test_every_path_computes_the_same_float8_logits():
    """The fused kernel, the eager passes and the per-token backward (which rebuilds the logits from the
    saved log-sum-exp) agree with each other under fp8."""
    eager, fused, per_token = (loss_and_grads("hybrid"), loss_and_grads("hybrid", compiled=True),
                               loss_and_grads("hybrid", per_token=True))
    for other in (fused, per_token):
        torch.testing.assert_close(other[0], eager[0], rtol=1e-5, atol=1e-5)
        assert relative(other[2], eager[2]) < 1e-4
        assert relative(other[1], eager[1]) < 0.02  # the logits gradient may fall into another fp8 step
    bf16 = loss_and_grads("hybrid", compute_dtype=torch.bfloat16)
    assert relative(bf16[0], eager[0]) < 0.01


def test_a_bad_format_is_refused():
    with pytest.raises(ValueError, match="choose from"):
        loss_and_grads("e5m2")


def test_the_flag_needs_fp8_and_the_chunked_output_layer(capsys):
    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args

    assert "--fp8-output-layer has no effect without --fp8-format" in parse_error(
        TINY + ["--fp8-output-layer", "--difflm-masked-only-loss"], capsys)
    assert "without --difflm-masked-only-loss" in parse_error(
        TINY + ["--fp8-output-layer", "--fp8-format", "hybrid"], capsys)
    args = parse_args(TINY + ["--fp8-output-layer", "--fp8-format", "e4m3", "--difflm-masked-only-loss"],
                      add_difflm_args, world_size=1)
    assert args.dlm_config.fp8_output_layer == "e4m3"
