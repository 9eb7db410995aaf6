"""The README's main job (bundled corpus, 2 gloo processes): the loss falls, tensorboard agrees."""

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

BUBBLE = re.compile(r"pipeline bubble \(1 - compute / forward-backward\): min ([0-9.]+)%, mean ([0-9.]+)%, "
                    r"max ([0-9.]+)% over (\d+) ranks")
ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


def tensorboard_scalars(log_dir: Path, tag: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Where the quickstart writes the tokenized corpus: the first run of this module tokenizes it,
    the others reuse it (as a user's second run does)."""
    return tmp_path_factory.mktemp("data")


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_two_process_training_lowers_the_loss(mode, tmp_path, data_dir):
    # The AR run skips the flags' check before torchrun (the DLM run makes it): 3 s of CI.
    env = dict(os.environ, MODE=mode, TRAIN_ITERS="20", TENSORBOARD_DIR=str(tmp_path / "tb"),
               DATA_DIR=str(data_dir), OMP_NUM_THREADS="1", CHECK_ARGS="0" if mode == "vanilla" else "1")
    result = subprocess.run(["bash", "examples/quickstart.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    console = {int(step): float(loss) for step, loss in LOSS.findall(result.stdout)}
    assert sorted(console) == list(range(1, 21)), "one line per iteration with --log-interval 1"
    first, last = [console[i] for i in range(1, 6)], [console[i] for i in range(16, 21)]
    assert sum(last) / 5 < 0.9 * sum(first) / 5, f"{mode}: loss did not fall ({first} -> {last})"
    recorded = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(recorded) == sorted(console)
    for step, value in console.items():
        assert recorded[step] == pytest.approx(value, rel=1e-6)
    assert "validation loss at iteration 20" in result.stdout
    assert (data_dir / "sotu_text_document.idx").exists(), "the bundled corpus was tokenized"
    assert "Warning" not in result.stderr + result.stdout, "the quickstart prints no framework warnings"
    rates = [float(rate) for rate in re.findall(r"TFLOP/s/GPU\): ([0-9.e-]+)", result.stdout)]
    assert len(rates) == 20 and all(rate > 0 for rate in rates), "a CPU run's throughput has digits"
    sample = re.search(r"^generated: (.+)$", result.stdout, re.MULTILINE)
    assert sample and len(sample.group(1).split()) >= 8, "a sample is generated from the saved checkpoint"


def test_four_processes_with_pipeline_and_tensor_parallelism(tmp_path, data_dir):
    """The README's pipeline command: 2 stages x 2 tensor-parallel ranks train the bundled corpus.
    (TP+SP with ZeRO-1 and every other layout are proven equal to one process in test_layout_matrix.py.)
    With the level-2 timers every rank times its compute and the log states the measured bubble."""
    env = dict(os.environ, NPROC="4", TRAIN_ITERS="20", TENSORBOARD_DIR=str(tmp_path / "tb"),
               DATA_DIR=str(data_dir), OMP_NUM_THREADS="1", CHECK_ARGS="0")
    flags = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--timing-log-level", "2"]
    result = subprocess.run(["bash", "examples/quickstart.sh", *flags], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "> pipeline stages" in result.stdout and "[0,2)" in result.stdout and "[2,4)" in result.stdout
    console = {int(step): float(loss) for step, loss in LOSS.findall(result.stdout)}
    first, last = [console[i] for i in range(1, 6)], [console[i] for i in range(16, 21)]
    assert sum(last) / 5 < 0.85 * sum(first) / 5, (first, last)
    assert result.stdout.count("    forward-compute ....") == result.stdout.count("    backward-compute ....") == 20
    bubbles = BUBBLE.findall(result.stdout)
    assert len(bubbles) == 20 and all(0 < float(low) <= float(high) < 100 for low, _, high, _ in bubbles), bubbles
    assert {ranks for *_, ranks in bubbles} == {"4"}, "every rank is a stage that timed its compute"
