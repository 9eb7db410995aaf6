"""The float8 working copies of --fp8-format (float8_copy.Float8Gemm, float8_matmul.float8_linear): the
decoder's linear layers run the tensorwise recipe themselves, from float8 copies of their weights that
each iteration's refresh casts with the weight's own amax.

Each test fails if its part broke: the GEMMs against the same products of tensorwise-cast operands
written out here, the refresh's cast (a wrong scale, a stale amax, a missing transposed copy), training
against bf16 in Megatron's default configuration and the Llama style, DLM and AR, evaluation against
stale buffers, and the command line."""

import math
import re

import pytest
import torch
from torch import nn

from megatron.core.optimizer.optimizer import OptimizerConfig, build_optimizer
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, scale_of, scaled_cast, to_float8
from megatron.core.precision.apply import PrecisionConfig, apply_precision
from megatron.core.precision.weight_copies import WeightCopies
from megatron.core.fp8.float8_copy import Float8Copy
from tests.unit_tests.test_bad_inputs_training import TINY, run_cli
from tests.unit_tests.test_gpt_model import tokens
from tests.unit_tests.test_weight_copies import build, train

@pytest.fixture(autouse=True)
def fresh_compile_caches():
    yield
    torch._dynamo.reset()  # each test compiles optimizer steps over new parameter lists


def _float8_values(tensor: torch.Tensor, dtype: torch.dtype, amax_of=None) -> torch.Tensor:
    """`tensor` on `dtype`'s grid, scaled tensorwise (the amax of `amax_of`, by default its own, onto the
    dtype's largest value, saturating) and back, in fp32: the operand a float8 GEMM multiplies, written out
    independently of the layers' casts."""
    largest = torch.finfo(dtype).max
    scale = (largest / (tensor if amax_of is None else amax_of).abs().max().double()).float()
    return (tensor.float() * scale).clamp(-largest, largest).to(dtype).float() / scale


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = module(x)
    (out.float() * grad).sum().backward()
    weight = next(p for name, p in module.named_parameters() if name.endswith("weight"))
    return out.float(), x.grad, weight.grad


@pytest.mark.parametrize("fp8_format, bias, device", [("hybrid", True, "cpu"), ("e4m3", False, "cpu"),
                                                      pytest.param("hybrid", True, "cuda", marks=pytest.mark.gpu),
                                                      pytest.param("hybrid", False, "compiled", marks=pytest.mark.gpu)])
def test_the_float8_gemms_multiply_the_tensorwise_cast_operands(fp8_format, bias, device):
    """Output, input gradient and weight gradient are the products of the float8 operands (the input and
    the output gradient in bf16 first, as autocast gives them), not of the bf16 ones. On CUDA the float8
    GEMMs are cuBLAS's; "compiled": our layer compiled by Inductor (its fused casts)."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 48, bias=bias, init_std=0.5)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    if device != "cpu":
        layer.cuda()
    copies = WeightCopies(nn.Sequential(layer), torch.bfloat16, fp8_format)
    assert copies.float8_layers == 1 and layer.gemm.rows.dtype == FORWARD_DTYPE
    x, grad = (torch.randn(2, 16, 64, device=layer.weight.device), torch.randn(2, 16, 48, device=layer.weight.device))
    ours = _run(torch.compile(layer) if device == "compiled" else layer, x, grad)
    x16, grad16 = x.reshape(-1, 64).bfloat16().float(), grad.reshape(-1, 48).bfloat16().float()
    shift = layer.bias.detach().bfloat16().float() if bias else 0.0
    x8 = _float8_values(x16, FORWARD_DTYPE)
    if device == "compiled":
        # Inductor keeps a fused kernel's intermediates in fp32 (torch._inductor.config.emulate_precision_casts
        # is off): the cast's kernel reads the fp32 input, skipping autocast's bf16 rounding, while the amax is
        # the rounded input's (measured on an H100: this reference within 0.2% of the output's largest value,
        # the eager one 1.85% away).
        x8 = _float8_values(x.reshape(-1, 64), FORWARD_DTYPE, amax_of=x16)
    w8, w16 = _float8_values(layer.weight.detach(), FORWARD_DTYPE), layer.weight.detach().bfloat16().float()
    operands = {"float8": (x8, w8, _float8_values(grad16, GRADIENT_DTYPES[fp8_format])),
                "bf16": (x16, w16, grad16)}
    products = {kind: ((a @ w.t() + shift).reshape(2, 16, 48), (g @ w).reshape(2, 16, 64), g.t() @ a)
                for kind, (a, w, g) in operands.items()}
    for index, name in enumerate(("output", "input grad", "weight grad")):
        mine, float8, bf16 = ours[index].float(), products["float8"][index], products["bf16"][index]
        error = (mine - float8).abs().max()
        assert error <= 0.01 * float8.abs().max(), name  # the GEMM's bf16 output rounding at most
        assert error < (mine - bf16).abs().max() / 4, name  # the operands were float8's
    assert x.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype,mantissa_bits", [(torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)])
def test_the_cast_puts_the_amax_on_the_largest_value(dtype, mantissa_bits):
    """Current scaling's cast (float8_matmul.to_float8): the amax lands on the dtype's largest value, and
    the values times the inverse scale are the tensor within the dtype's rounding."""
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(0)) * 1e-3
    x8, inverse = to_float8(x, dtype)
    assert x8.dtype == dtype and x8.float().abs().max() == torch.finfo(dtype).max
    back = x8.float() * inverse
    large = x.abs() > x.abs().max() / 50
    assert ((back - x).abs() / x.abs())[large].max() <= 2.0 ** -(mantissa_bits + 1)


def test_each_refresh_casts_the_stepped_weights_with_their_own_amax():
    """Current scaling, whatever wrote the weight: the compiled step writes no float8 copy (a stale or
    a wrong scale, a missing transposed copy would fail here)."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 48, bias=False, init_std=0.5)
    holder = nn.Sequential(layer)
    optimizer = build_optimizer(holder, OptimizerConfig(lr=5e-2, weight_decay=0.0, compiled_step=True))
    copies = apply_precision(holder, PrecisionConfig(True, "hybrid"), torch.bfloat16, optimizer)
    assert copies.copy_of(layer.weight) is None  # the step does not write it
    for _ in range(2):
        assert copies.refresh() == 1
        weight = layer.weight.detach()
        amax = weight.abs().amax()
        expected = scaled_cast(weight, scale_of(amax, FORWARD_DTYPE), FORWARD_DTYPE)
        assert torch.equal(layer.gemm.rows.float(), expected.float())
        assert torch.equal(layer.gemm.columns.float(), expected.t().float())
        assert torch.allclose(layer.gemm.inverse_scale, scale_of(amax, FORWARD_DTYPE).reciprocal())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(32, 64)).float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert not torch.equal(layer.weight.detach().abs().amax(), amax)  # the step moved it


@pytest.mark.parametrize("style, mode", [("megatron", "vanilla"), ("llama", "difflm-noshift")])  # each once
def test_float8_training_follows_bf16_within_float8s_rounding(style, mode):
    losses, _, stale, copies = train(style, mode, copies=True, compiled=True, fp8_format="hybrid")
    bf16_losses = train(style, mode, copies=False, compiled=True)[0]
    assert copies.float8_layers == len(copies.pairs) == 2 * 4 and stale == [8, 8, 8]  # cast every iteration
    assert losses != bf16_losses  # the GEMMs ran in float8
    for mine, bf16 in zip(losses, bf16_losses):
        assert abs(mine - bf16) < 5e-3 * bf16, (losses, bf16_losses)  # float8 rounding apart


def test_evaluation_casts_the_weights_afresh():
    model = build("llama", "vanilla")
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, compiled_step=True))
    copies = apply_precision(model, PrecisionConfig(True, "hybrid"), torch.bfloat16, optimizer)
    x = tokens(seed=5)
    bf16 = build("llama", "vanilla").eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = model.compute_loss(x, key=None).loss
        with torch.no_grad():
            training_forward = model(x, labels=x)[1]
            model.eval()
            evaluated = model(x, labels=x)[1]
            # in float8 (the same values the refreshed copies hold), not in bf16
            assert torch.equal(evaluated, training_forward) and not torch.equal(evaluated, bf16(x, labels=x)[1])
        for module, copy in copies.layers:
            assert isinstance(copy, Float8Copy)
            copy.rows.zero_(), copy.columns.zero_()  # stale buffers: evaluation does not read them
        with torch.no_grad():
            assert torch.equal(model(x, labels=x)[1], evaluated)
        model.train()
        assert not torch.equal(model.compute_loss(x, key=None).loss, trained)  # training does


def test_the_command_line_trains_in_float8_from_the_copies():
    """The trainer's wiring: the copies attached after the wrapper and counted as the fp8 layers, and the
    masked-only loss's output weight with a bf16 copy (the numbers are the tests above)."""
    run = run_cli(*TINY, "--bf16", "--train-iters", "3", "--log-interval", "1", "--lr", "1e-2", "--micro-batch-size",
                  "2", "--global-batch-size", "4", "--fp8-format", "hybrid", "--cache-low-precision-weights",
                  "--difflm-masked-only-loss")
    assert run.returncode == 0, run.stderr[-2000:]
    copies = re.search(r"> (\d+) linear layers read working copies of their weights, (\d+) of them in float8",
                       run.stdout)
    line = re.search(r"> fp8: (\d+) linear layers train in float8 \(hybrid, tensorwise\)", run.stdout)
    assert copies and line and int(line.group(1)) == int(copies.group(2)) == int(copies.group(1)) - 1 > 0
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_compiled_layers_trace_the_float8_gemms_without_a_graph_break():
    """fullgraph=True: a graph break (the copies' lookup, the cast's compiled wrapper) would raise;
    the compiled layers train the same losses as the eager ones."""
    from megatron.core.transformer.compilation import compile_transformer_layers

    results = []
    for compiled in (False, True):
        model = build("megatron", "vanilla")
        if compiled:
            compile_transformer_layers(model, backend="aot_eager", fullgraph=True)
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
        copies = apply_precision(model, PrecisionConfig(True, "hybrid"), torch.bfloat16, optimizer)
        losses = []
        for step in range(2):
            copies.refresh()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.compute_loss(tokens(seed=step), key=None).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results.append(losses)
    assert results[0] == pytest.approx(results[1], rel=1e-6)
