"""tools/benchmark/rl_table.py: dlm_rl.sh's table read from posttrain_rl.py's own log lines (a tiny CPU run's),
against the values the trainer kept."""

import contextlib
import io
import statistics

import pytest

from tests.unit_tests.test_rl_training import MODEL, run, task_file
from tools.benchmark import rl_table


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 6-step AR GRPO run's log and its trainer."""
    folder = tmp_path_factory.mktemp("rl_table")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer = run(MODEL + ["--rl-task", task_file(folder), "--rl-valid-task", task_file(folder),
                               "--rl-eval-prompts", "4", "--eval-interval", "6", "--eval-iters", "1",
                               "--model-running-mode", "vanilla", "--rl-algorithm", "grpo", "--lr", "3e-2",
                               "--train-iters", "6"])
    return log.getvalue(), trainer


def test_the_figures_are_the_trainers(tiny_run):
    log, trainer = tiny_run
    figures = rl_table.run_figures(log)
    assert figures["reward"] == [round(value, 4) for value in trainer.rollout_rewards]
    assert figures["entropy"] == pytest.approx(trainer.rollout_entropy, abs=1e-4)
    assert len(figures["step_ms"]) == 6 and len(figures["tokens_per_s"]) == 6 and len(figures["validation"]) == 1
    assert len(figures["length"]) == 6 and all(1 <= length <= 8 for length in figures["length"])  # gen length 8
    assert figures["update_tokens_per_s"] == pytest.approx(trainer.update_throughput, abs=0.051)
    assert len(trainer.update_throughput) == 6 and min(trainer.update_throughput) > 0


def test_the_row_summarises_the_run(tiny_run):
    log, _ = tiny_run
    figures = rl_table.run_figures(log)
    row = rl_table.table_row("ar_grpo", None, log, windows=3)
    reward = figures["reward"]
    curve = " ".join(f"{(reward[i] + reward[i + 1]) / 2:.2f}" for i in (0, 2, 4))
    assert row.startswith(f"| ar_grpo | 6 | - -> {figures['validation'][-1]:.3f} | {reward[0]:.3f} -> {reward[-1]:.3f} "
                          f"| {curve} |")
    length = figures["length"]
    assert row.endswith(f"| {length[0]:.1f} -> {length[-1]:.1f} | {statistics.median(figures['tokens_per_s']):.0f} | "
                        f"{statistics.median(figures['update_tokens_per_s']):.0f} | "
                        f"{statistics.median(figures['step_ms']) / 1000:.2f} |")
    with pytest.raises(ValueError, match="no rollouts line"):
        rl_table.table_row("empty", None, "nothing here", windows=3)
