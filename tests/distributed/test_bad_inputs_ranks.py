"""Bad input met by several ranks under torchrun: every rank that meets it says so in one line and
the launch ends (no rank is left waiting in a collective).

A damaged shard and a failing save are met by every rank together (DCP gathers the ranks'
failures): each rank raises the same error, none prints a traceback, and the first to exit ends
the launch (torchrun stops the rest, which may not have printed their copy of the line yet). An id outside the
vocabulary is met by the rank that reads that sample: it prints its line and exits, and torchrun
stops the others (under gloo a peer blocked in a collective may report the closed connection).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.distributed.parity import free_port
from tests.unit_tests.test_bad_inputs_training import DISK_FULL_AT_4

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--add-mask-token",
        "--eval-iters", "0", "--log-interval", "1", "--attention-backend", "math"]


def torchrun(script, *flags, nproc=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), str(script), *TINY, *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def error_lines(result) -> list:
    assert result.returncode != 0, result.stdout[-2000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def assert_the_ranks_say(result, *parts):
    """The same line from each rank that got to print it (torchrun stops the others once one exits)."""
    lines = error_lines(result)
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, result.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    assert not any(line.startswith("[rank") and "Traceback" in line for line in result.stderr.splitlines())


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    result = torchrun("pretrain_difflm.py", "--mock-data", "--train-iters", "4", "--save", str(root),
                      "--save-interval", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_a_damaged_shard_stops_every_rank_with_its_name(saved_run, tmp_path):
    ckpt = Path(shutil.copytree(saved_run, tmp_path / "ckpt"))
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    result = torchrun("pretrain_difflm.py", "--mock-data", "--train-iters", "6", "--load", str(ckpt))
    assert_the_ranks_say(result, str(shard), "the checkpoint is damaged", "--ckpt-step 2")


def test_a_full_disk_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    wrapper, root = tmp_path / "disk_full.py", tmp_path / "ckpt"
    wrapper.write_text(DISK_FULL_AT_4)
    result = torchrun(wrapper, "--mock-data", "--train-iters", "4", "--save", str(root), "--save-interval", "2")
    assert_the_ranks_say(result, "saving iteration 4 failed (No space left on device)", "still names iteration 2")
    assert sorted(path.name for path in root.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_an_id_outside_the_vocabulary_met_by_one_rank_ends_the_launch(tmp_path):
    prefix = str(tmp_path / "late")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in range(340):  # 68000 good tokens (past what the flags' check reads), then bad ones
        builder.add_document(np.arange(400) % 60 + (70 if document >= 170 else 0))
    builder.finalize(prefix + ".idx")
    result = torchrun("pretrain_difflm.py", "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
                      "--train-iters", "10")
    lines = error_lines(result)
    assert 1 <= len(lines) <= 2 and all(f"{prefix}.bin, sequence " in line for line in lines), result.stderr[-3000:]
