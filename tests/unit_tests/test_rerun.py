"""The rerun state machine (--rerun-mode and its checks) and the numerics logging flags, in one process."""

import math
import warnings
from typing import Callable, Dict

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.training.arguments import parse_args
from megatron.training.rerun import SpikeDetector, relative_difference
from tests.distributed.parity import TINY_GQA
from tests.unit_tests.test_training import make_trainer as tiny_trainer

DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
"""A re-run matches the first execution only if the dropout RNG states are restored before it."""


def make_trainer(runtime, *extra, forward_step=pretrain_difflm.forward_step):
    return tiny_trainer(runtime, *extra, forward_step=forward_step, base=TINY_GQA)


def planting(calls: Dict[int, int], plant: Callable[[int, int], float]):
    """A forward step that counts the executions of every step (0-based iteration -> count) and
    multiplies the model's output by plant(iteration, execution) (1: unchanged)."""
    def forward_step(data_iterator, model, ctx, config):
        output, loss_func = pretrain_difflm.forward_step(data_iterator, model, ctx, config)
        if ctx.microbatch == 0:
            calls[ctx.iteration] = calls.get(ctx.iteration, 0) + 1
        factor = plant(ctx.iteration, calls[ctx.iteration])
        return (output if factor == 1 else output * factor), loss_func
    return forward_step


def test_a_one_off_nan_is_transient_and_the_step_trains_on_the_rerun(runtime):
    reference = make_trainer(runtime, *DROPOUT)
    reference.train()
    calls = {}
    trainer = make_trainer(runtime, *DROPOUT, forward_step=planting(
        calls, lambda iteration, execution: math.nan if (iteration, execution) == (1, 1) else 1))
    state = trainer.train()
    assert calls == {0: 1, 1: 2, 2: 1}
    assert (trainer.rerun.transient_errors, trainer.rerun.reproducible_errors) == (1, 0)
    assert state.skipped_iterations == 0 and state.nan_iterations == 0
    # The re-run saw the same micro-batches and dropout masks: the run is the clean run, bit for bit.
    assert [r.loss for r in trainer.history] == [r.loss for r in reference.history]
    for (name, param), expected in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(param, expected), name


@pytest.mark.parametrize("flags, executions", [([], 2), (["--rerun-mode", "disabled"], 1),
                                               (["--no-check-for-nan-in-loss-and-grad"], 1)])
def test_a_persistent_nan_is_reproducible_and_its_update_skipped(runtime, flags, executions):
    calls = {}
    trainer = make_trainer(runtime, *flags, forward_step=planting(
        calls, lambda iteration, execution: math.nan if iteration == 1 else 1))
    state = trainer.train()
    assert calls == {0: 1, 1: executions, 2: 1}
    assert trainer.rerun.reproducible_errors == (1 if executions == 2 else 0)
    assert trainer.rerun.transient_errors == 0
    assert [r.skipped for r in trainer.history] == [False, True, False]
    assert state.nan_iterations == 1 and trainer.scheduler.num_steps == 2


@pytest.mark.parametrize("kind, transient", [("transient_error", True), ("persistent_error", False)])
def test_error_injection_exercises_both_verdicts(runtime, tmp_path, kind, transient):
    tracker = tmp_path / "rejected.txt"
    calls = {}
    trainer = make_trainer(runtime, "--error-injection-rate", "1", "--error-injection-type", kind,
                           "--result-rejected-tracker-filename", str(tracker),
                           forward_step=planting(calls, lambda iteration, execution: 1))
    state = trainer.train()
    assert calls == {0: 2, 1: 2, 2: 2}
    assert (trainer.rerun.transient_errors, trainer.rerun.reproducible_errors) == ((3, 0) if transient else (0, 3))
    assert state.skipped_iterations == (0 if transient else 3)
    lines = tracker.read_text().splitlines()
    verdict = "first_rerun_not_reproducible" if transient else "first_rerun_reproducible"
    assert [line.split(" status=")[1].split()[0] for line in lines] == ["initial_run", verdict] * 3
    assert all(f"iteration={i}" in lines[2 * i - 1] for i in (1, 2, 3))


def test_a_reproducible_loss_spike_is_rerun_and_applied(runtime):
    calls = {}
    trainer = make_trainer(runtime, "--check-for-spiky-loss", forward_step=planting(
        calls, lambda iteration, execution: 1e4 if iteration == 2 else 1))
    spike_check = next(check for check in trainer.rerun.checks if check.message == "spiky loss")
    spike_check.rejects = SpikeDetector(samples=2)  # the reference maximum from 2 steps, not Megatron's 100
    trainer.train()
    assert calls == {0: 1, 1: 1, 2: 2}
    assert trainer.rerun.reproducible_errors == 1
    assert not trainer.history[2].skipped, "a spike is not fatal (Megatron): its update is applied"


def test_report_stats_reruns_the_logged_steps_and_reports_variability(runtime, capsys):
    calls = {}
    trainer = make_trainer(runtime, "--rerun-mode", "report_stats", "--log-interval", "2", "--train-iters", "4",
                           forward_step=planting(calls, lambda iteration, execution: 1))
    trainer.train()
    assert calls == {0: 1, 1: 2, 2: 1, 3: 2}
    assert trainer.rerun.variability["loss"].differences == [0.0, 0.0]  # CPU kernels are deterministic
    assert "rerun stats (report_stats): loss: 2/2 re-runs/identical" in capsys.readouterr().out
    assert trainer.history[3].numerics.scalars["rerun/loss-variability-max"] == 0.0


def test_params_norm_and_zero_gradients_are_logged(runtime, capsys):
    trainer = make_trainer(runtime, "--log-params-norm", "--log-num-zeros-in-grad", "--log-interval", "1",
                           "--train-iters", "2")
    trainer.train()
    numerics = trainer.history[-1].numerics
    by_hand = math.sqrt(sum(float(p.detach().double().square().sum()) for p in trainer.model.parameters()))
    assert numerics.params_norm == pytest.approx(by_hand, rel=1e-6)
    # The last step's gradients are still there: the unused vocabulary rows get exact zeros.
    zeros = sum(int((p.grad == 0).sum()) for p in trainer.model.parameters())
    assert numerics.num_zeros == zeros > 0
    last_line = [line for line in capsys.readouterr().out.splitlines() if "iteration        2/" in line][0]
    assert f"| grad norm: {trainer.history[-1].grad_norm:.3f} | num zeros: {zeros} | params norm: {by_hand:.3f} |" \
        in last_line
    assert {"num-zeros", "params-norm"} <= set(numerics.all_scalars())


class NaNInBackward(torch.autograd.Function):
    """Identity forward, NaN gradient: a fault only backward shows."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


def nan_in_backward(data_iterator, model, ctx, config):
    output, loss_func = pretrain_difflm.forward_step(data_iterator, model, ctx, config)
    return NaNInBackward.apply(output), loss_func


def test_detect_anomaly_names_the_backward_that_made_a_nan(runtime):
    plain = make_trainer(runtime, "--rerun-mode", "disabled", forward_step=nan_in_backward)
    assert plain.train_step(plain.train_loader(0)).skipped  # without it: a silently skipped step
    trainer = make_trainer(runtime, "--detect-anomaly", forward_step=nan_in_backward)
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(RuntimeError, match="NaNInBackwardBackward.* returned nan values"):
        warnings.simplefilter("always")
        trainer.train_step(trainer.train_loader(0))
    assert any("Anomaly Detection has been enabled" in str(w.message) for w in caught)


def test_relative_difference_and_spike_detector():
    assert relative_difference(math.nan, math.nan) == 0 == relative_difference(math.inf, math.inf)
    assert relative_difference(math.nan, 1.0) == math.inf == relative_difference(math.inf, math.nan)
    assert relative_difference(1.0, 3.0) == pytest.approx(1.0)
    detector = SpikeDetector(factor=10, samples=2)
    assert [detector(v) for v in (2.0, 3.0, 29.0, 30.0, math.nan, -31.0)] == [False, False, False, True, False, True]


@pytest.mark.parametrize("flags, message", [
    (["--error-injection-type", "persistent_error"], "--error-injection-type has no effect without "
                                                     "--error-injection-rate > 0"),
    (["--check-for-spiky-loss", "--rerun-mode", "report_stats"], "--check-for-spiky-loss has no effect without"),
    (["--error-injection-rate", "5", "--rerun-mode", "disabled"], "--error-injection-rate has no effect without"),
    (["--result-rejected-tracker-filename", "/nonexistent/dir/file"], "cannot be written"),
])
def test_bad_rerun_flags_exit_2_with_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY_GQA + flags, add_difflm_args, world_size=1)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
