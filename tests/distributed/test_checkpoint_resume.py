"""--save/--load: bit-exact resume, signals and crashes (layout changes: test_checkpoint_reshard.py)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed.parity import run_entry_point
from tests.distributed.test_pretrain_cli import LOSS, tensorboard_scalars
from tests.launch_flags import recorded_flags

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def train(tmp_path, nproc, *flags, iters=20):
    """`MOCK_DATA=1 NPROC=nproc bash examples/quickstart.sh --eval-iters 0 flags`: exactly its
    training, run by fork-server workers instead of torchrun (the script itself, through torchrun,
    is test_pretrain_cli.py's and the signal tests' below). ({iteration: console loss}, console)."""
    env = {"TRAIN_ITERS": str(iters), "MOCK_DATA": "1", "TENSORBOARD_DIR": str(tmp_path / "tb")}
    argv = recorded_flags("examples/quickstart.sh", tmp_path, env, "--eval-iters", "0", *flags)
    _, console = run_entry_point(nproc, argv, console=True)
    return {int(step): loss for step, loss in LOSS.findall(console)}, console


def checkpoint_at(ckpt: Path, iteration: int, root: Path) -> Path:
    """A --save directory holding only iteration `iteration` of `ckpt` (its tracker names it)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(Path(ckpt) / name, Path(root) / name)
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return Path(root)


def final_weights(ckpt) -> dict:
    from tools.weights_conversion.checkpoint_io import read_tensors, stored_shapes

    iteration = int((Path(ckpt) / "latest_checkpointed_iteration.txt").read_text())
    iter_dir = str(Path(ckpt) / f"iter_{iteration:07d}")
    shapes = stored_shapes(iter_dir)
    return read_tensors(iter_dir, list(shapes), shapes)


DROPOUT_AND_EVAL = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "1",
                    "--eval-interval", "4"]
SMALLER = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "64",
           "--micro-batch-size", "4", "--global-batch-size", "8",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]  # quickstart's model, cut to test speed
RESUME_CASES = {  # name: (processes, flags)
    "one_process_dlm_varilen": (1, ["--model-running-mode", "difflm-noshift", "--difflm-varilen-prob", "0.3"]),
    # A block-size curriculum whose sizes change before and after the resume (steps 4 and 8, 0-based), with the
    # joint AR + DLM and the confidence-aware losses.
    "one_process_block_curriculum": (1, ["--model-running-mode", "difflm-noshift", "--difflm-block-diffusion",
                                         "--difflm-block-size-schedule", "0:8,4:16,8:32",
                                         "--difflm-ar-loss-weight", "0.5", "--difflm-confidence-loss-weight", "0.3"]),
    "tp2_sp_dp2_zero1_dlm": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--use-distributed-optimizer", "--micro-batch-size", "2"]),
    # One layer per stage, 2 micro-batches per step; evaluation runs the forward-only schedule.
    "pp2_tp2_sp_dlm": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"]),
    # AR (causal, load-balanced chunks) under context parallelism.
    "cp2_ar": (2, ["--context-parallel-size", "2", "--model-running-mode", "vanilla"]),
    # fp8 with delayed scaling: the amax histories and scales are state the checkpoint carries, a file per
    # rank; the pipeline stages hold other layers, so a rank reading another's file would show.
    "pp2_fp8_delayed_ar": (2, ["--bf16", "--fp8-format", "hybrid", "--cache-low-precision-weights", "--fp8-recipe",
                               "delayed", "--fp8-amax-history-len", "3", "--fp8-amax-compute-algo", "max",
                               "--model-running-mode", "vanilla", "--pipeline-model-parallel-size", "2"]),
    # MoE under EP=2 with aux-loss-free balancing: the expert biases are state the checkpoint carries.
    "ep2_moe_expert_bias_dlm": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                                    "--expert-model-parallel-size", "2", "--moe-router-score-function", "sigmoid",
                                    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
                                    "--moe-z-loss-coeff", "0.001"]),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_with_dropout_and_evaluation_is_bit_exact(case, tmp_path):
    """12 iterations straight (saving iteration 6 on the way) equal iteration 6 loaded and trained 6
    more: every printed loss, and the final weights bit for bit, with dropout on and evaluations
    (which must not touch training's RNG streams). (Saving at an --exit-interval: the SIGTERM test.)"""
    nproc, flags = RESUME_CASES[case]
    flags = SMALLER + flags + DROPOUT_AND_EVAL
    straight, _ = train(tmp_path, nproc, *flags, "--save", str(tmp_path / "straight"), "--save-interval", "6",
                        iters=12)
    ckpt = str(checkpoint_at(tmp_path / "straight", 6, tmp_path / "ckpt"))
    second, out = train(tmp_path, nproc, *flags, "--load", ckpt, "--save", ckpt, iters=12)
    assert "loaded" in out and sorted(second) == list(range(7, 13))
    if "--num-experts" in flags:  # the routers' statistics, on the console and in tensorboard, every step
        assert out.count("moe z loss:") == 6 and "expert load max/min:" in out
        assert sorted(tensorboard_scalars(tmp_path / "tb", "moe/layer-1/max-load"))[-6:] == list(range(7, 13))
    if "--difflm-block-size-schedule" in flags:  # the size of each logged step; the checkpoint records its own
        assert re.search(r"iteration +8/.*block size: 16 \|", out)
        assert re.search(r"iteration +9/.*block size: 32 \|", out)
        scalars = tensorboard_scalars(tmp_path / "tb", "block-size")
        assert (scalars[4], scalars[5], scalars[8], scalars[9]) == (8.0, 16.0, 16.0, 32.0)
        metadata = json.loads((Path(ckpt) / "iter_0000006" / "metadata.json").read_text())
        assert metadata["dlm_config"]["block_size"] == 16
    assert second == {step: straight[step] for step in range(7, 13)}, "lm loss must match the uninterrupted run"
    expected, resumed = final_weights(tmp_path / "straight"), final_weights(ckpt)
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after the resume"


def ancestors(pid: int) -> list:
    """The parent, grandparent, ... process ids of `pid` (Linux /proc)."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        chain.append(pid)
    return chain


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    import re
    import signal

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, NPROC="2", TRAIN_ITERS="2000", MOCK_DATA="1", OMP_NUM_THREADS="1",
               TENSORBOARD_DIR=str(tmp_path / "tb"))
    process = subprocess.Popen(["bash", "examples/quickstart.sh", "--eval-iters", "0", "--save", str(ckpt),
                                "--exit-signal-handler"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:  # wait until training is under way
        lines.append(line)
        if re.search(r"iteration +3/", line):
            break
    # A scheduler's preemption notice reaches the training processes themselves (this run's
    # only: another suite on the machine may be training too).
    workers = [pid for pid in subprocess.run(["pgrep", "-f", r"python[0-9.]* -u pretrain_difflm.py"],
                                             capture_output=True, text=True).stdout.split()
               if process.pid in ancestors(int(pid))]
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(int(pid), signal.SIGTERM)
    output = "".join(lines) + process.stdout.read()
    assert process.wait(timeout=300) == 0, output[-3000:]
    assert "exit signal received" in output
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 2000 and (ckpt / f"iter_{saved:07d}" / "metadata.json").exists()
    # A later save killed halfway leaves files but no tracker update: resume ignores it.
    broken = ckpt / f"iter_{saved + 5:07d}"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"partial")
    resumed, out = train(tmp_path, 2, "--load", str(ckpt), iters=saved + 12)
    assert f"at iteration {saved}" in out and sorted(resumed) == list(range(saved + 1, saved + 13))


def test_a_save_killed_with_sigkill_leaves_the_previous_checkpoint_loadable(tmp_path):
    import signal
    import time

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, NPROC="2", TRAIN_ITERS="2000", MOCK_DATA="1", OMP_NUM_THREADS="1",
               TENSORBOARD_DIR=str(tmp_path / "tb"))
    process = subprocess.Popen(["bash", "examples/quickstart.sh", "--eval-iters", "0", "--save", str(ckpt),
                                "--save-interval", "1", "--hidden-size", "256", "--ffn-hidden-size", "768"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    target, deadline = ckpt / "iter_0000005", time.time() + 300
    while not target.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.001)
    # Both ranks (torchrun puts them in sessions of their own), in the middle of writing iteration 5.
    subprocess.run(["pkill", "-KILL", "-f", f"pretrain_difflm.py .*--save {ckpt} "])
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert target.exists(), "training never reached the fifth save"
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved in (4, 5), saved
    resumed, out = train(tmp_path, 2, "--load", str(ckpt), "--hidden-size", "256", "--ffn-hidden-size", "768",
                         iters=saved + 12)
    assert f"at iteration {saved}" in out and sorted(resumed) == list(range(saved + 1, saved + 13))
