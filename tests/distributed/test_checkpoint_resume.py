"""--save/--load: bit-exact resume, and a checkpoint written under TP=2 continuing under TP=1."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_pretrain_cli import LOSS

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def train(tmp_path, nproc, *flags, iters=20):
    env = dict(os.environ, NPROC=str(nproc), TRAIN_ITERS=str(iters), MOCK_DATA="1", OMP_NUM_THREADS="1",
               TENSORBOARD_DIR=str(tmp_path / "tb"))
    result = subprocess.run(["bash", "examples/quickstart.sh", "--eval-iters", "0", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {int(step): loss for step, loss in LOSS.findall(result.stdout)}, result.stdout


@pytest.mark.parametrize("mode_flags", [["--model-running-mode", "difflm-noshift", "--difflm-varilen-prob", "0.3"],
                                        ["--model-running-mode", "vanilla"]])
def test_resume_is_bit_exact(mode_flags, tmp_path):
    straight, _ = train(tmp_path, 2, *mode_flags)
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, 2, *mode_flags, "--save", ckpt, "--exit-interval", "10")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    second, out = train(tmp_path, 2, *mode_flags, "--load", ckpt)
    assert "loaded" in out and sorted(second) == list(range(11, 21))
    resumed = {**first, **second}
    assert resumed == straight, "lm loss must match the uninterrupted run at every iteration, as printed"


def test_checkpoint_from_tp2_continues_under_tp1(tmp_path):
    # 511 tokens + the mask pad to 512 rows under both layouts (vocab padding depends on tp).
    vocab = ["--vocab-size", "511"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    straight, _ = train(tmp_path, 2, *vocab, *tp2, iters=12)
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, 2, *vocab, *tp2, "--save", ckpt, "--exit-interval", "10", iters=12)
    resumed, out = train(tmp_path, 1, *vocab, "--load", ckpt, iters=12)
    assert "loaded" in out and sorted(resumed) == [11, 12]
    for step in (11, 12):
        assert float(resumed[step]) == pytest.approx(float(straight[step]), rel=1e-5)


def test_resume_with_tensor_parallelism_and_the_distributed_optimizer_is_bit_exact(tmp_path):
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]
    straight, _ = train(tmp_path, 4, *flags, iters=14)
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, 4, *flags, "--save", ckpt, "--exit-interval", "7", iters=14)
    second, _ = train(tmp_path, 4, *flags, "--load", ckpt, iters=14)
    assert {**first, **second} == straight
