"""--cache-low-precision-weights on gloo: a bf16 run with the copies trains the same losses as one
without, under ZeRO-1 (each rank's compiled step writes its own shard's copies; the shards the other
ranks broadcast move no version counter, so they must be re-cast) and under TP=2 with sequence
parallelism, in Megatron's default configuration and the Llama style, DLM and AR."""

import pytest

from tests.distributed.parity import run_many
from tests.distributed.test_layout_matrix import CONFIGS, MODES, SHAPE, TP2_SP

pytestmark = pytest.mark.distributed

CASES = [  # (layout flags, config, mode, optimizer flags)
    (["--use-distributed-optimizer"], "llama", "dlm", ["--compile-optimizer-step"]),
    (["--use-distributed-optimizer"], "megatron", "ar", ["--compile-optimizer-step"]),
    (TP2_SP, "megatron", "dlm", []),
    (TP2_SP, "llama", "ar", ["--compile-optimizer-step"]),
]


def test_copies_train_the_same_losses_under_zero1_and_tensor_parallelism(tmp_path):
    argvs = []
    for layout, config, mode, optimizer in CASES:
        base = SHAPE + CONFIGS[config] + MODES[mode] + layout + optimizer + ["--bf16", "--lr", "1e-2"]
        argvs += [base, base + ["--cache-low-precision-weights"]]
    results = run_many(2, argvs, tmp_path, "copies")
    for index, (layout, config, mode, _) in enumerate(CASES):
        without, with_copies = results[2 * index], results[2 * index + 1]
        assert len(without["losses"]) == 3
        # the same bf16 values reach the same GEMMs: the same losses to the bit
        assert with_copies["losses"] == without["losses"], (layout, config, mode)
