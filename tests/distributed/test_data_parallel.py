"""Data parallelism on gloo equals one process with gradient accumulation, step for step."""

import pytest

from tests.distributed.parity import TINY_GQA, assert_same_training, run

pytestmark = pytest.mark.distributed

ARGV = TINY_GQA + ["--micro-batch-size", "2", "--global-batch-size", "8", "--reset-attention-mask",
                   "--reset-position-ids", "--difflm-t-sampling", "antithetic"]


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_two_data_parallel_ranks_match_one_process(mode, tmp_path):
    argv = ARGV + ["--model-running-mode", mode]
    single, parallel = run(1, argv, tmp_path, "single"), run(2, argv, tmp_path, "dp2")
    assert (single["microbatches"], parallel["microbatches"]) == (4, 2)
    assert_same_training(single, parallel)
