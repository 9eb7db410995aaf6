"""Checkpoints are never lost or mixed, and loading one never runs code from it.

Saves are staged and renamed into place (a SIGKILL while rewriting an existing iteration keeps
it loadable), a --save directory is locked against a second run, --keep-last-checkpoints only
prunes this run's older iterations and the tracker never moves back, and DCP's pickled index
goes through an allow-list unpickler.
"""

import hashlib
import os
import pickle
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.training import checkpoint_files, checkpointing
from megatron.training.configs import CheckpointConfig

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
        "--add-mask-token", "--eval-iters", "0", "--log-interval", "1", "--attention-backend", "math",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def pretrain(*flags, wait=True, timeout=300):
    command = [sys.executable, "pretrain_difflm.py", *TINY, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def digest(directory: Path) -> dict:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def weights(root: Path) -> dict:
    model, _ = checkpointing.load_inference_model(str(root), torch.device("cpu"))
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_one_line_error(result, *words):
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert errors, result.stderr[-2000:]
    for word in words:
        assert word in errors[0], errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run: iteration 4 saved by the real command line (once per module)."""
    ckpt = tmp_path_factory.mktemp("finished") / "ckpt"
    result = pretrain("--train-iters", "4", "--save", str(ckpt))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    return ckpt


@pytest.fixture()
def saved(finished_run, tmp_path):
    """This test's own copy of the finished run's checkpoint directory, ckpt/."""
    return Path(shutil.copytree(finished_run, tmp_path / "ckpt"))


def test_sigkill_while_rewriting_an_existing_iteration_keeps_it_loadable(saved):
    before = weights(saved)
    # The finished job relaunched with --load X --save X rewrites iteration 4 at its end; kill it
    # as soon as that save has started writing.
    process = pretrain("--train-iters", "4", "--load", str(saved), "--save", str(saved), "--hidden-size", "32",
                       wait=False)
    staged, deadline = saved / "iter_0000004.tmp", time.time() + 120
    while not staged.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.0005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "4"
    after = weights(saved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_completed_rewrite_replaces_the_iteration_and_leaves_no_staging(saved):
    before = weights(saved)
    result = pretrain("--train-iters", "4", "--load", str(saved), "--save", str(saved))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    after = weights(saved)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_crash_between_the_two_renames_is_read_from_the_replaced_copy(saved):
    before = weights(saved)
    final = saved / "iter_0000004"
    final.rename(saved / "iter_0000004.replaced")  # as if killed right after moving the old copy aside
    after = weights(saved)
    assert all(torch.equal(before[k], after[k]) for k in before)
    staged = saved / "iter_0000004.tmp"
    staged.mkdir()
    (staged / "partial").write_text("x")  # an unfinished staging directory never counts
    assert checkpoint_files.iteration_dir(str(saved), 4).endswith(".replaced")


def test_a_second_run_on_the_same_save_directory_is_refused(saved, tmp_path):
    first = pretrain("--train-iters", "3000", "--save", str(saved), "--save-interval", "1000", wait=False)
    lock, deadline = saved / ".save.lock", time.time() + 120
    while not lock.exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.01)
    try:
        second = pretrain("--train-iters", "2", "--save", str(saved))
        assert_one_line_error(second, f"--save {saved}", "in use by another run", f"pid {first.pid}")
        assert first.poll() is None, "the first run goes on"
    finally:
        first.kill()
        first.wait(timeout=60)
    assert weights(saved), "the checkpoint the first run found still loads"


def test_a_stale_lock_of_a_dead_process_on_this_host_is_taken_over(saved):
    import json
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (saved / ".save.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    result = pretrain("--train-iters", "5", "--load", str(saved), "--save", str(saved))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not (saved / ".save.lock").exists(), "released at the end"


def _finalize(root: Path, iteration: int, keep):
    staged = root / f"iter_{iteration:07d}.tmp"
    staged.mkdir()
    (staged / "metadata.json").write_text("{}")
    checkpointing.finalize_save(CheckpointConfig(save=str(root), keep_last_checkpoints=keep), iteration)


def test_keep_last_prunes_only_older_iterations_and_the_tracker_never_moves_back(tmp_path, capsys):
    root = tmp_path / "shared"
    root.mkdir()
    for iteration in (8, 10):  # another run's checkpoints
        _finalize(root, iteration, None)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    for iteration in (1, 2, 3):
        _finalize(root, iteration, 2)
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))
    assert names == ["iter_0000002", "iter_0000003", "iter_0000008", "iter_0000010"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert "keeps naming 10" in capsys.readouterr().err


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_index_never_runs_code_on_load(saved, tmp_path):
    from tools.weights_conversion import checkpoint_io

    marker = tmp_path / "pwned"
    index = saved / "iter_0000004" / ".metadata"
    index.write_bytes(pickle.dumps(_WritesAFile(str(marker))))
    result = pretrain("--train-iters", "6", "--load", str(saved))
    assert_one_line_error(result, ".metadata", "refusing to unpickle")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        checkpointing.load_inference_model(str(saved), torch.device("cpu"))  # generation and evaluation
    with pytest.raises(ValueError, match="refusing to unpickle"):
        checkpoint_io.stored_shapes(str(saved / "iter_0000004"))  # the Hugging Face export
    assert not marker.exists(), "unpickling the index ran code"


def test_use_checkpoint_args_resumes_without_the_architecture_flags(saved):
    shapeless = [flag for flag in TINY]
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        at = shapeless.index(flag)
        del shapeless[at:at + 2]
    command = [sys.executable, "pretrain_difflm.py", *shapeless, "--use-checkpoint-args", "--load", str(saved),
               "--train-iters", "6", "--rotary-base", "500000"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    # The checkpoint's architecture (and rotary base: it overrides the command line) was used.
    assert "loaded" in result.stdout and re.search(r"iteration +6/ +6 \|", result.stdout), result.stdout[-2000:]


def test_a_checkpoint_computing_another_function_is_refused_before_the_model_is_built(saved):
    result = pretrain("--train-iters", "6", "--load", str(saved), "--rotary-base", "500000")
    assert_one_line_error(result, "rotary_base=10000.0", "--rotary-base", "--finetune")
    assert "parameters" not in result.stdout, "refused before the model was built"
    assert pretrain("--train-iters", "6", "--load", str(saved), "--rotary-base", "500000",
                    "--finetune").returncode == 0
