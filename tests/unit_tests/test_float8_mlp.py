"""The float8 SwiGLU MLP as one function (float8_mlp.py) and its two fused kernels (fused_float8_swiglu.py).

Each test fails if its part broke: a kernel writing other bytes than SwiGLU's kernel followed by the cast
kernel (a wrong tile offset, the up half's pointer, the rounding to 16 bits before the cast, the
transposed layout's second half) or another amax; the MLP computing other outputs, gradients or recorded
amaxes than its two float8 layers one after the other, calling the fused kernels without given scales or
not calling them with; the MLP taking the fused path where a layer is not float8 (bias, GeLU, no copies).

On CPU both sides run under Triton's interpreter, which rounds float8 its own way, identically on both
sides: the comparisons are exact. On CUDA the fused kernels are checked against the unfused ones on
random values."""

import copy

import pytest
import torch

from megatron.core.fusions import triton_support
from megatron.core.fp8 import float8_mlp
from megatron.core.fusions import fused_float8_cast, fused_float8_swiglu
from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES
from megatron.core.fp8.float8_scaling import DelayedScalingConfig
from megatron.core.precision.weight_copies import WeightCopies
from megatron.core.fusions import fused_swiglu
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig

E5M2 = GRADIENT_DTYPES["hybrid"]
INTERPRETER = pytest.mark.skipif(not (triton_support.HAS_TRITON and triton_support.interpreting()),
                                 reason="CPU tensors under Triton's interpreter (CPU machines run it)")


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    yield
    torch._dynamo.reset()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _same(ours, theirs) -> None:
    for mine, expected in zip(ours, theirs):
        assert mine.dtype == expected.dtype and mine.shape == expected.shape
        if mine.dtype in (FORWARD_DTYPE, E5M2):
            assert torch.equal(_bytes(mine), _bytes(expected))
        else:
            assert torch.equal(mine, expected)


def _inputs(rows: int, f: int, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * f, generator=generator) * 3).to(torch.bfloat16).to(device)
    grad = (torch.randn(rows, f, generator=generator) * 5).to(torch.bfloat16).to(device)
    return h, grad


def _check_kernels(h: torch.Tensor, grad: torch.Tensor, scales) -> None:
    forward_scale, backward_scale = (torch.tensor(s, device=h.device) for s in scales)
    activation = fused_swiglu.swiglu(h)
    _same(fused_float8_swiglu.swiglu_cast(h, forward_scale, FORWARD_DTYPE),
          fused_float8_cast.cast_both_layouts(activation, forward_scale, FORWARD_DTYPE))
    assert torch.equal(fused_float8_swiglu.swiglu_cast(h, forward_scale, FORWARD_DTYPE)[2],
                       activation.abs().max().float())
    grad_h = fused_swiglu.swiglu_backward(grad, h)
    _same(fused_float8_swiglu.swiglu_backward_cast(grad, h, backward_scale, E5M2),
          fused_float8_cast.cast_both_layouts(grad_h, backward_scale, E5M2))
    assert torch.equal(fused_float8_swiglu.swiglu_backward_cast(grad, h, backward_scale, E5M2)[2],
                       grad_h.abs().max().float())


@INTERPRETER
@pytest.mark.parametrize("rows, f", [(40, 56), (32, 48)], ids=["partial-tiles", "whole-tiles"])
def test_the_fused_kernels_write_what_swiglu_then_the_cast_write(rows, f, monkeypatch):
    """Both layouts' bytes and the amax, forward and backward, under the interpreter's 16 x 16 tiles;
    the scales saturate some values."""
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    h, grad = _inputs(rows, f)
    _check_kernels(h, grad, (20.0, 300.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_tensor_math_backward_is_autograds(dtype):
    """`reference_backward` (the fused function's backward where SwiGLU's kernels do not run) is autograd's
    gradient of SwiGLU's tensor math, to the bit."""
    generator = torch.Generator().manual_seed(3)
    h, grad = (torch.randn(8, 64, generator=generator) * 4).to(dtype), torch.randn(8, 32, generator=generator).to(dtype)
    leaf = h.clone().requires_grad_()
    fused_swiglu.reference(leaf).backward(grad)
    assert torch.equal(fused_swiglu.reference_backward(grad, h), leaf.grad)


def _mlp(fusion: bool, bias: bool = False, activation: str = "silu", delayed: bool = True, device: str = "cpu"):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               gated_linear_unit=activation == "silu", activation=activation,
                               add_bias_linear=bias, bias_swiglu_fusion=fusion)
    module = MLP(config).to(device)
    twin = copy.deepcopy(module)
    config_delayed = DelayedScalingConfig() if delayed else None
    return (module, WeightCopies(module, torch.bfloat16, "hybrid", config_delayed),
            twin, WeightCopies(twin, torch.bfloat16, "hybrid", config_delayed))


def _step(module: MLP, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    for parameter in module.parameters():
        parameter.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = module(x)
    out.float().backward(grad)
    amaxes = [layer.gemm.amax.clone() for layer in (module.linear_fc1, module.linear_fc2)
              if getattr(layer.gemm, "delayed_scaling", False)]
    return [out, x.grad] + [p.grad for p in module.parameters()] + amaxes


@INTERPRETER
@pytest.mark.parametrize("kernels", [True, False], ids=["triton-interpreter", "tensor-math"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "tensorwise"])
def test_the_fused_mlp_trains_as_its_two_float8_layers(kernels, delayed, monkeypatch):
    """Two iterations (delayed scaling: the first by the tensors' own amaxes, the second by the scales
    that iteration set, its input 3x larger so that casts saturate): output, input and weight gradients
    and both layers' recorded amaxes equal the layer-by-layer path's; the fused kernels run exactly where
    the scales are given and SwiGLU's kernels are on."""
    monkeypatch.setattr(triton_support, "interpreter_allowed", True)
    calls = []
    for name in ("swiglu_cast", "swiglu_backward_cast"):
        original = getattr(fused_float8_swiglu, name)
        monkeypatch.setattr(fused_float8_swiglu, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    fused, fused_copies, plain, plain_copies = _mlp(kernels, delayed=delayed)
    assert fused.fused_forward is float8_mlp.swiglu_mlp  # installed by the converter
    plain.fused_forward = None  # the path before the fused function: layer by layer
    generator = torch.Generator().manual_seed(1)
    x, grad = torch.randn(16, 2, 32, generator=generator), torch.randn(16, 2, 32, generator=generator) * 1e-3
    for iteration, scale in enumerate((1.0, 3.0)):
        ours = _step(fused, x * scale, grad)
        reference = _step(plain, x * scale, grad)
        _same(ours, reference)
        ready = delayed and iteration == 1
        assert calls == (["swiglu_cast", "swiglu_backward_cast"] if ready and kernels else []), (iteration, calls)
        calls.clear()
        for copies in (fused_copies, plain_copies):
            copies.end_iteration()


@pytest.mark.parametrize("change", ["bias", "gelu", "no-copies"])
def test_the_fused_function_runs_only_float8_swiglu_without_fc1_bias(change, monkeypatch):
    """Megatron's default MLP (biases, GeLU) and a bf16 MLP keep the layers' own path."""
    module = _mlp(True, bias=change == "bias", activation="gelu" if change == "gelu" else "silu")[0]
    if change == "no-copies":
        module = MLP(module.config)
    monkeypatch.setattr(float8_mlp, "_Float8SwiGLUMLP", None)  # any call fails
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(torch.randn(16, 2, 32)).float().sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("rows, f", [(8192, 14336), (272, 1040)], ids=["7b-fc2", "partial"])
def test_on_cuda_the_fused_kernels_write_what_swiglu_then_the_cast_write(rows, f):
    h, grad = _inputs(rows, f, "cuda")
    fused_float8_swiglu.register_for(h)
    _check_kernels(h, grad, (20.0, 300.0))


@pytest.mark.gpu
def test_on_cuda_the_compiled_mlp_traces_the_fused_kernels():
    """A compiled float8 MLP with ready delayed scales calls both fused kernels inside its graph (the
    autograd function's forward and backward bodies: no graph break) and trains as the eager MLP."""
    graphs = []

    def recording(graph, example_inputs):  # every traced graph's code, the autograd function's bodies too
        graphs.append("\n".join(module.code for module in graph.modules() if isinstance(module, torch.fx.GraphModule)))
        return torch._dynamo.lookup_backend("inductor")(graph, example_inputs)
    module, copies, twin, twin_copies = _mlp(True, device="cuda")
    x = torch.randn(512, 2, 32, device="cuda")
    grad = torch.randn(512, 2, 32, device="cuda") * 1e-2
    for each, state in ((module, copies), (twin, twin_copies)):
        _step(each, x, grad)
        state.end_iteration()
    ours = _step(torch.compile(module, backend=recording, fullgraph=True), 2 * x, grad)
    reference = _step(twin, 2 * x, grad)
    assert any("float8_swiglu." in code for code in graphs) and any("float8_swiglu_backward" in code for code in graphs)
    for mine, theirs in zip(ours, reference):  # Inductor's casts round within float8's
        torch.testing.assert_close(mine, theirs, rtol=0.1, atol=0.1 * theirs.abs().max().item())


def test_float8_layers_under_torch_compile_on_a_cpu_are_one_line(capsys, monkeypatch):
    """Inductor's CPU code computes NaN gradients for them (see precision_args.validate_precision_args):
    refused before any work, with the fix; on a GPU the same flags parse, and so does a launch script's
    --check-args on a machine without one."""
    from tests.unit_tests.test_bad_inputs_training import TINY, parse_error

    flags = TINY + ["--bf16", "--fp8-format", "hybrid", "--cache-low-precision-weights", "--torch-compile"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = parse_error(flags, capsys)
    assert "--torch-compile with --fp8-format on a CPU" in message and "drop --torch-compile" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args

    assert parse_args(flags, add_difflm_args, world_size=1).torch_compile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a launch script's check on a login node
    assert parse_args(flags + ["--check-args"], add_difflm_args, world_size=1).check_args


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True], ids=["llama-no-bias", "megatron-bias"])
def test_on_cuda_a_compiled_float8_layer_trains_as_the_eager_one(dropout, bias):
    """A whole transformer layer of float8 layers, compiled by Inductor, over two iterations of delayed
    scaling: every gradient finite (on a CPU Inductor's vectorized code made them NaN with dropout and no
    biases, hence the refusal above), and without dropout within float8's rounding of the eager layer's."""
    from megatron.core.transformer.attention_mask import AttentionMask
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                               gated_linear_unit=not bias, activation="silu" if not bias else "gelu",
                               add_bias_linear=bias, hidden_dropout=dropout, attention_dropout=dropout)
    layers = [TransformerLayer(config, 0).cuda() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    copies = [WeightCopies(layer, torch.bfloat16, "hybrid", DelayedScalingConfig()) for layer in layers]
    compiled, mask = torch.compile(layers[0]), AttentionMask("no_mask")
    for step in range(2):
        x = torch.randn(256, 4, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step)) * (step + 1)
        grads = []
        for module, layer in ((compiled, layers[0]), (layers[1], layers[1])):
            inputs = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = module(inputs, mask)
            out.float().square().mean().backward()
            grads.append([inputs.grad] + [p.grad for p in layer.parameters()])
            layer.zero_grad(set_to_none=True)
        for mine, theirs in zip(*grads):
            assert mine.isfinite().all(), step
            if dropout == 0.0:
                torch.testing.assert_close(mine, theirs, rtol=0.1, atol=0.1 * theirs.abs().max().item())
        for each in copies:
            each.end_iteration()
