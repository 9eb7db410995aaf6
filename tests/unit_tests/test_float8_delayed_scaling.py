"""--fp8-recipe delayed (float8_scaling.py): the float8 layers cast their input and output gradient by
scales from earlier iterations' amaxes.

Each test fails if its part broke: the update's arithmetic (Megatron's formula, the history, the
margin, a zero or non-finite amax, a skipped iteration), the layer's casts (the first iteration is the
tensorwise recipe bit for bit, the next ones saturate at the last iteration's amax, both amaxes are
recorded, forward and backward), the compiled layers (the recording traced without a graph break), the
flags, and training from the command line (resume: tests/distributed/test_checkpoint_resume.py; the
replicas' shared amax: tests/distributed/test_weight_copies_parallel.py)."""

import copy
import math
import re

import pytest
import torch
from torch import nn

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.fusions import fused_float8_cast
from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, scale_of
from megatron.core.fp8.float8_scaling import DelayedScaling, DelayedScalingConfig
from megatron.core.precision.weight_copies import WeightCopies
from tests.unit_tests.test_bad_inputs_training import TINY, parse_error, run_cli

E4M3, E5M2 = torch.finfo(FORWARD_DTYPE).max, torch.finfo(GRADIENT_DTYPES["hybrid"]).max


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    yield
    torch._dynamo.reset()


def _gemm() -> Float8Gemm:
    """A float8 GEMM of a [16, 16] weight, as the converter gives a layer."""
    return Float8Gemm(torch.zeros(16, 16), GRADIENT_DTYPES["hybrid"])


@pytest.mark.parametrize("algo, margin", [("most_recent", 0), ("max", 1)])
def test_the_update_is_megatrons_delayed_scaling(algo, margin):
    """Four iterations of two layers' amaxes, written through each GEMM's own buffer view, against the
    formula computed here: scale = largest / amax / 2^margin, amax the latest or the history's largest;
    a zero or non-finite amax keeps the scale it had; a skipped iteration changes nothing."""
    gemms = [_gemm(), _gemm()]
    scaling = DelayedScaling(gemms, ["first", "second"], "hybrid", DelayedScalingConfig(3, algo, margin))
    assert not scaling.ready and not any(gemm.delayed_ready for gemm in gemms)
    assert torch.equal(scaling.scales, torch.ones(2, 2))
    iterations = [[[2.0, 8.0], [0.5, 0.0]], [[4.0, math.inf], [1.0, 2.0]], [[1.0, 1.0], [0.25, 4.0]],
                  [[3.0, 0.5], [2.0, 0.125]]]
    history = [[[] for _ in range(2)] for _ in range(2)]
    expected = [[1.0, 1.0], [1.0, 1.0]]
    for index, amaxes in enumerate(iterations):
        for gemm, values in zip(gemms, amaxes):
            gemm.amax.copy_(torch.tensor(values))
        if index == 2:  # a skipped iteration: its amaxes are dropped
            before = (scaling.history.clone(), scaling.scales.clone())
            scaling.update(skipped=True)
            assert torch.equal(scaling.current, torch.zeros(2, 2))
            assert torch.equal(scaling.history, before[0]) and torch.equal(scaling.scales, before[1])
            continue
        scaling.update()
        for row in range(2):
            for column, largest in enumerate((E4M3, E5M2)):
                value = amaxes[row][column]
                history[row][column] = ([value if math.isfinite(value) else 0.0] + history[row][column])[:3]
                amax = history[row][column][0] if algo == "most_recent" else max(history[row][column])
                if amax > 0:
                    expected[row][column] = largest / amax / 2 ** margin
        assert scaling.ready and all(gemm.delayed_ready for gemm in gemms)
        assert torch.allclose(scaling.scales, torch.tensor(expected), rtol=1e-6), (index, scaling.scales, expected)
        padded = [[column + [0.0] * (3 - len(column)) for column in row] for row in history]
        assert torch.equal(scaling.history, torch.tensor(padded).transpose(1, 2)), index
        assert torch.equal(scaling.current, torch.zeros(2, 2))


def test_a_checkpointed_state_loads_only_where_it_fits():
    gemms = [_gemm()]
    scaling = DelayedScaling(gemms, ["layer"], "e4m3", DelayedScalingConfig(2))
    gemms[0].amax.copy_(torch.tensor([2.0, 4.0]))
    scaling.update()
    state = scaling.state_dict()
    other = DelayedScaling([_gemm()], ["layer"], "e4m3", DelayedScalingConfig(2))
    assert other.load_state_dict(state) is None and other.ready
    assert torch.equal(other.scales, scaling.scales) and torch.equal(other.history, scaling.history)
    assert "are not this rank's 1 (another layout)" in DelayedScaling([_gemm()], ["renamed"], "e4m3",
                                            DelayedScalingConfig(2)).load_state_dict(state)
    longer = DelayedScaling([_gemm()], ["layer"], "e4m3", DelayedScalingConfig(3))
    assert "--fp8-amax-history-len" in longer.load_state_dict(state) and not longer.ready


def _pair(seed: int = 0, device: str = "cpu"):
    """A float8 layer with delayed scaling and its twin with the tensorwise recipe (the same weights)."""
    torch.manual_seed(seed)
    layer = ColumnParallelLinear(64, 48, bias=True, init_std=0.5).to(device)
    with torch.no_grad():
        layer.bias.normal_()
    twin = copy.deepcopy(layer)
    delayed = WeightCopies(nn.Sequential(layer), torch.bfloat16, "hybrid", DelayedScalingConfig())
    WeightCopies(nn.Sequential(twin), torch.bfloat16, "hybrid")
    return layer, twin, delayed


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = module(x)
    (out.float() * grad).sum().backward()
    return out.float(), x.grad


def test_the_first_iteration_is_tensorwise_and_the_next_casts_by_its_amaxes():
    layer, twin, copies = _pair()
    x, grad = torch.randn(2, 16, 64), torch.randn(2, 16, 48)
    first, reference = _run(layer, x, grad), _run(twin, x, grad)
    for mine, theirs in zip(first, reference):
        assert torch.equal(mine, theirs)  # no history yet: each tensor by its own amax
    x_amax, grad_amax = x.to(torch.bfloat16).abs().max().float(), grad.to(torch.bfloat16).abs().max().float()
    assert torch.equal(layer.gemm.amax, torch.stack([x_amax, grad_amax]))  # forward's and backward's
    copies.end_iteration()
    assert torch.equal(layer.gemm.scales, torch.stack([scale_of(x_amax, FORWARD_DTYPE),
                                                     scale_of(grad_amax, GRADIENT_DTYPES["hybrid"])]))
    # The next iteration's input is 3x larger: cast by the last amax, its largest values saturate.
    bigger = 3 * x
    out, x_grad = _run(layer, bigger, grad)
    scale = layer.gemm.scales[0]
    x8 = (bigger.to(torch.bfloat16).float() * scale).clamp(-E4M3, E4M3).to(FORWARD_DTYPE).float() / scale
    weight = layer.gemm.rows.float() * layer.gemm.inverse_scale
    expected = x8 @ weight.t() + layer.bias.detach().to(torch.bfloat16).float()
    assert (out - expected).abs().max() < 1e-2 * expected.abs().max()  # bf16 output's rounding
    tensorwise = _run(twin, bigger, grad)
    assert (out - tensorwise[0]).abs().max() > 0.2 * expected.abs().max()  # the saturation shows
    # The output gradient's amax did not move: its scale is what tensorwise computes, bit for bit.
    assert torch.equal(x_grad, tensorwise[1])
    assert torch.equal(layer.gemm.amax, torch.stack([bigger.to(torch.bfloat16).abs().max().float(), grad_amax]))


def test_evaluation_scales_by_the_current_amax_and_records_nothing():
    layer, twin, copies = _pair(seed=1)
    x = torch.randn(32, 64)
    _run(layer, x, torch.randn(32, 48))
    copies.end_iteration()
    layer.eval(), twin.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(5 * x), twin(5 * x))
    assert torch.equal(layer.gemm.amax, torch.zeros(2))


@pytest.mark.parametrize("device, backend", [("cpu", "aot_eager"),
                                             pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_compiled_layers_record_the_amaxes_without_a_graph_break(device, backend):
    """fullgraph=True: the forward's record and the backward's (a buffer written in a compiled backward)
    trace; the compiled layer's outputs, gradients and amaxes are the eager layer's (Inductor's fused
    casts: within float8's rounding), and the flag that turns the scales on recompiles once."""
    eager, _, eager_copies = _pair(seed=2, device=device)
    layer, _, copies = _pair(seed=2, device=device)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    for step in range(3):
        x, grad = torch.randn(32, 64, device=device) * (step + 1), torch.randn(32, 48, device=device) / (step + 1)
        for mine, theirs in zip(_run(compiled, x, grad), _run(eager, x, grad)):
            if backend == "aot_eager":
                assert torch.equal(mine, theirs), step
            else:
                assert (mine - theirs).abs().max() <= 0.07 * theirs.abs().max(), step
        assert torch.equal(layer.gemm.amax, eager.gemm.amax) and layer.gemm.amax.min() > 0
        copies.end_iteration(), eager_copies.end_iteration()
        assert torch.equal(layer.gemm.scales, eager.gemm.scales)


def _two_layers(device: str):
    torch.manual_seed(3)
    model = nn.Sequential(ColumnParallelLinear(64, 64, bias=True, init_std=0.5),
                          ColumnParallelLinear(64, 32, bias=False, init_std=0.5)).to(device)
    return model, WeightCopies(model, torch.bfloat16, "hybrid", DelayedScalingConfig())


@pytest.mark.parametrize("device, backend, kernel", [("cpu", "aot_eager", False),
                                                     pytest.param("cuda", "inductor", True, marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda"])
def test_compiled_layers_with_micro_batches_in_flight(device, backend, kernel, monkeypatch):
    """Two compiled layers, two micro-batches' forwards before either backward (a pipeline schedule's
    order): the running amaxes move between a layer's forward and its backward, which a compiled backward
    that wrote into them would refuse under torch 2.11 (a saved tensor's version moved); the backward's
    amax leaves as a gradient, raising the same amaxes as the eager layers'. The leaf keeps no gradient.
    From the second step the casts run through the Triton kernel (`kernel`; traced into the graph; under
    the interpreter only eagerly, test_float8_cast.py: its kernels are not traceable)."""
    calls, graphs, original = [], [], fused_float8_cast.cast_both_layouts
    monkeypatch.setattr(fused_float8_cast, "cast_both_layouts",  # eager calls counted (compiled code: the graphs)
                        lambda *args: (None if torch.compiler.is_compiling() else calls.append(1)) or original(*args))

    def recording(graph, example_inputs):  # every traced graph's code, the autograd.Function's bodies too
        graphs.append("\n".join(module.code for module in graph.modules() if isinstance(module, torch.fx.GraphModule)))
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)
    eager, eager_copies = _two_layers(device)
    model, copies = _two_layers(device)
    compiled = [torch.compile(layer, backend=recording, fullgraph=True) for layer in model]
    for step in range(3):
        inputs = [torch.randn(32, 64, device=device) * (step + part + 1) for part in range(2)]
        outputs = {}
        for name, layers in (("compiled", compiled), ("eager", list(eager))):
            with torch.autocast(device, dtype=torch.bfloat16):
                outputs[name] = [layers[1](layers[0](x)) for x in inputs]
        for part in range(2):  # the second micro-batch's backward first, as pipeline schedules may
            for name in outputs:
                (outputs[name][1 - part].float() * (part + 1) * 3).sum().backward()
        for mine, theirs in zip(model, eager):  # Inductor's casts round within float8's: so do the amaxes after
            tolerance = 0 if backend == "aot_eager" else 0.02
            assert torch.allclose(mine.gemm.amax, theirs.gemm.amax, rtol=tolerance, atol=0), step
            assert mine.gemm.amax.min() > 0 and mine.gemm.gradient_amax.grad is None
        assert model[1].gemm.amax[1] == 6.0  # the last layer's output gradients: 3, then 6 everywhere
        copies.end_iteration(), eager_copies.end_iteration()
    assert bool(calls) == kernel and any("float8_cast_both_layouts" in code for code in graphs) == kernel


def test_a_bad_history_length_is_one_line(capsys):
    message = parse_error(TINY + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                  "--fp8-amax-history-len", "0"], capsys)
    assert message.endswith("--fp8-amax-history-len 0: must be at least 1")


def test_the_command_line_trains_with_delayed_scaling():
    run = run_cli(*TINY, "--bf16", "--train-iters", "4", "--log-interval", "1", "--lr", "1e-2", "--micro-batch-size",
                  "2", "--global-batch-size", "4", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                  "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max")
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"> fp8: \d+ linear layers train in float8 \(hybrid, delayed\)", run.stdout)
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    noted = run_cli(*TINY, "--bf16", "--train-iters", "1", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024")
    assert noted.returncode == 0 and "--fp8-amax-history-len has no effect without --fp8-recipe delayed" in noted.stderr


def test_a_checkpoints_histories_load_or_start_afresh_in_one_line(tmp_path):
    """The trainer's load (checkpoint_files.py): this rank's file restores the state; a missing one starts
    afresh and says so; an unreadable one is one line naming the file, not a traceback."""
    from types import SimpleNamespace

    from megatron.core.errors import InputError
    from megatron.training.checkpoint_files import load_precision_state, save_precision_state

    def trainer():
        layer = ColumnParallelLinear(16, 16)
        copies = WeightCopies(nn.Sequential(layer), torch.bfloat16, "hybrid", DelayedScalingConfig())
        return SimpleNamespace(weight_copies=copies), copies.delayed_scaling

    saved, scaling = trainer()
    scaling.gemms[0].amax.copy_(torch.tensor([3.0, 5.0]))
    scaling.update()
    path = str(tmp_path / "fp8" / "rank_0.pt")
    save_precision_state(saved, path)
    loaded, restored = trainer()
    lines = []
    load_precision_state(loaded, path, lines.append)
    assert not lines and restored.ready and torch.equal(restored.scales, scaling.scales)
    load_precision_state(trainer()[0], str(tmp_path / "missing.pt"), lines.append)
    assert len(lines) == 1 and "amax histories start afresh" in lines[0]
    with open(path, "wb") as handle:
        handle.write(b"not a checkpoint")
    with pytest.raises(InputError, match=r"rank_0\.pt cannot be read .*delete it"):
        load_precision_state(trainer()[0], path, lines.append)
