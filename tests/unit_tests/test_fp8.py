"""--fp8-format from the command line: one fp8 backend, the float8 layers of the weights' working copies
(fp8/float8_matmul.py, precision/weight_copies.py). The flag alone turns the copies on (with a note),
FSDP2 and fp32 compute are refused, the default recipe is said to differ from Megatron's, and the
levers removed for measuring as losses are refused in one line each. Each test fails if its part broke:
a model built by the trainer whose linears are not float8 layers (or do not run float8 GEMMs), a
missing or extra note, a refusal that is not one line naming the flag and what to pass instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from custom_args.difflm import add_difflm_args
from megatron.core.distributed.data_parallel import unwrap
from megatron.core.fp8.float8_matmul import float8_gemms_on_cpu
from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.training.arguments import parse_args
from tests.unit_tests.test_bad_inputs_training import TINY, error_line, parse_error
from tests.unit_tests.test_training import make_trainer

ROOT = Path(__file__).resolve().parents[2]
COPIES_NOTE = "note: --fp8-format turns on --cache-low-precision-weights"
RECIPE_NOTE = "note: --fp8-recipe is tensorwise by default here, delayed in Megatron-LM"


def notes(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]


def test_fp8_format_alone_trains_the_linears_as_float8_layers(runtime, monkeypatch):
    """No --cache-low-precision-weights: every decoder linear holds a float8 copy of its weight and one
    iteration's GEMMs run in float8 (torch._scaled_mm), through the trainer as pretrain_difflm.py builds it."""
    gemms = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: gemms.append(a[0].dtype) or scaled_mm(*a, **k))
    trainer = make_trainer(runtime, "--bf16", "--fp8-format", "e4m3", "--train-iters", "1")
    model = unwrap(trainer.model)
    linears = [m for m in model.decoder.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and trainer.weight_copies is not None
    assert trainer.weight_copies.float8_layers == len(linears)
    assert all(isinstance(linear.gemm, Float8Gemm) for linear in linears)
    assert {linear.gemm.gradient_dtype for linear in linears} == {torch.float8_e4m3fn}  # e4m3 gradients too
    trainer.train()
    assert len(gemms) >= 3 * len(linears)  # each layer's output, input gradient and weight gradient
    assert set(gemms) == {torch.float8_e4m3fn}


def test_fp8_format_turns_the_copies_on_with_one_note(capsys):
    args = parse_args(TINY + ["--bf16", "--fp8-format", "hybrid"], add_difflm_args, world_size=1)
    lines = notes(capsys)
    assert args.cache_low_precision_weights and sum(line.startswith(COPIES_NOTE) for line in lines) == 1
    explicit = parse_args(TINY + ["--bf16", "--fp8-format", "hybrid", "--cache-low-precision-weights"],
                          add_difflm_args, world_size=1)
    assert explicit.cache_low_precision_weights and not any(line.startswith(COPIES_NOTE) for line in notes(capsys))
    plain = parse_args(TINY + ["--bf16"], add_difflm_args, world_size=1)
    assert not plain.cache_low_precision_weights and notes(capsys) == []


def test_the_recipe_default_is_tensorwise_and_says_megatrons_is_delayed(capsys):
    args = parse_args(TINY + ["--bf16", "--fp8-format", "hybrid"], add_difflm_args, world_size=1)
    assert args.fp8_recipe == "tensorwise" and any(line.startswith(RECIPE_NOTE) for line in notes(capsys))
    delayed = parse_args(TINY + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"], add_difflm_args,
                         world_size=1)
    assert delayed.fp8_recipe == "delayed" and delayed.cache_low_precision_weights  # no flag of the copies needed
    assert not any(line.startswith(RECIPE_NOTE) for line in notes(capsys))


@pytest.mark.parametrize("extra, message", [
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"],
     "--fp8-format trains from float8 working copies of the weights, which FSDP2"),
    (["--use-torch-fsdp2"], "(--data-parallel-sharding-strategy optim_grads_params) cannot keep"),
])
def test_fp8_under_fsdp2_is_one_line(extra, message, capsys):
    line = parse_error(TINY + ["--bf16", "--fp8-format", "hybrid"] + extra, capsys)
    assert message in line and line.endswith("use --data-parallel-sharding-strategy optim (ZeRO-1) or drop "
                                             "--fp8-format")


@pytest.mark.parametrize("extra, needed", [([], "--bf16 or --fp16"),
                                           (["--bf16", "--no-gradient-accumulation-fusion"],
                                            "gradient-accumulation fusion")])
def test_fp8_where_the_float8_layers_would_not_run_is_one_line(extra, needed, capsys):
    line = parse_error(TINY + ["--fp8-format", "e4m3"] + extra, capsys)
    assert f"--fp8-format has no effect without {needed}" in line


@pytest.mark.parametrize("argv, shown, fix", [
    (["--rmsnorm-fusion"], "--rmsnorm-fusion", "drop the flag"),
    (["--fp8-output-layer"], "--fp8-output-layer", "drop the flag"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], "--fp8-recipe rowwise",
     "use --fp8-recipe tensorwise or delayed"),
    (["--fp8-recipe=rowwise"], "--fp8-recipe rowwise", "use --fp8-recipe tensorwise or delayed"),
])
def test_a_removed_lever_is_refused_in_one_line(argv, shown, fix, capsys):
    line = parse_error(TINY + argv, capsys)
    assert f"{shown} was removed: " in line and "docs/performance.md" in line and line.endswith(fix)


def test_a_removed_lever_stops_the_check_args_run():
    """The launch scripts' check: the removed flag read from the command line itself, before any work."""
    result = subprocess.run([sys.executable, "pretrain_difflm.py", "--check-args", *TINY, "--rmsnorm-fusion"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--rmsnorm-fusion was removed" in error_line(result.stderr)


def test_float8_gemms_on_cpu_leave_onednn_only_for_cpu_runs():
    """oneDNN's float8 matmul is a reference loop on CPUs with AMX tiles (the quickstart's fp8 run took
    over 10 minutes there): CPU runs turn it off for torch's own kernel, CUDA runs leave it alone."""
    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = True
        float8_gemms_on_cpu(torch.device("cuda", 0))
        assert torch.backends.mkldnn.enabled
        float8_gemms_on_cpu(torch.device("cpu"))
        assert not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())
        a, b = torch.randn(32, 64), torch.randn(48, 64)
        one = torch.tensor(1.0)
        product = torch._scaled_mm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), one, one,
                                   out_dtype=torch.float32)
        widened = a.to(torch.float8_e4m3fn).float() @ b.to(torch.float8_e4m3fn).float().t()
        torch.testing.assert_close(product, widened)
    finally:
        torch.backends.mkldnn.enabled = enabled


def test_fp8_training_on_the_quickstart_learns():
    """12 steps of the quickstart's model with --bf16 --fp8-format hybrid: finite losses that fall."""
    from tests.distributed.test_pretrain_cli import LOSS

    env = dict(os.environ, NPROC="1", TRAIN_ITERS="12", MOCK_DATA="1", OMP_NUM_THREADS="2",
               TENSORBOARD_DIR="/tmp/fp8-test-tb", CHECK_ARGS="0")  # the flags' check: test_launch_scripts.py
    result = subprocess.run(["bash", "examples/quickstart.sh", "--eval-iters", "0", "--bf16", "--fp8-format", "hybrid"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "> fp8: 16 linear layers train in float8 (hybrid, tensorwise)" in result.stdout  # 4 layers x 4
    losses = [float(loss) for _, loss in LOSS.findall(result.stdout)]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]), losses
