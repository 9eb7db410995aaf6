"""Tensor (+ sequence) parallelism, alone and with data parallelism, equals one process.

Every layout trains 3 steps of a tiny GQA model from the same initial weights (weights are
drawn whole per parameter and sliced), in DLM and AR modes: per-step losses and, after
step 1, every gradient assembled to its full shape match the single-process run.
"""

import pytest

from tests.distributed.parity import TINY_GQA, assert_same_training, run

pytestmark = pytest.mark.distributed

ARGV = TINY_GQA + ["--micro-batch-size", "2", "--global-batch-size", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]

# layout: (world size, model flags shared with the reference, parallel flags)
LAYOUTS = {
    "tp2_tied": (2, [], ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, UNTIED, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp4_two_kv_heads": (4, UNTIED, ["--tensor-model-parallel-size", "4"]),
    "tp2_sp_dp2_tied": (4, [], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_layout_matches_one_process(layout, mode, tmp_path):
    world_size, model_flags, parallel_flags = LAYOUTS[layout]
    argv = ARGV + model_flags + ["--model-running-mode", mode]
    assert_same_training(run(1, argv, tmp_path, "reference"),
                         run(world_size, argv + parallel_flags, tmp_path, layout))
