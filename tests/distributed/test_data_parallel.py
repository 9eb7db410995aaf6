"""Data parallelism on gloo equals one process with gradient accumulation, step for step (every
strategy over the configuration matrix: test_layout_matrix.py; here the special cases)."""

import pytest

from tests.distributed.parity import TINY_GQA, assert_same_training, run

pytestmark = pytest.mark.distributed

ARGV = TINY_GQA + ["--micro-batch-size", "2", "--global-batch-size", "8", "--reset-attention-mask",
                   "--reset-position-ids", "--difflm-t-sampling", "antithetic"]




def test_masked_only_loss_under_fsdp2_matches_one_process_with_full_logits(tmp_path):
    """The chunked masked-only loss saves the (tied) output weight for its backward: FSDP2's
    unsharded parameters must still be the ones it saw."""
    argv = ARGV + ["--model-running-mode", "difflm-noshift"]
    single = run(1, argv, tmp_path, "single")
    parallel = run(2, argv + ["--data-parallel-sharding-strategy", "optim_grads_params",
                              "--difflm-masked-only-loss", "--difflm-loss-chunk-size", "16"], tmp_path, "fsdp2")
    assert_same_training(single, parallel, by_name=True)


def test_sharded_optimizer_state_is_a_quarter_on_four_replicas(tmp_path):
    """ZeRO-1 (optim) and ZeRO-3 (optim_grads_params) against no_shard, in one set of processes."""
    from tests.distributed.parity import run_many

    argv = TINY_GQA + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "4",
                       "--train-iters", "1"]
    strategies = ["no_shard", "optim", "optim_grads_params"]
    results = run_many(4, [argv + ["--data-parallel-sharding-strategy", strategy] for strategy in strategies],
                       tmp_path, "sharding")
    whole = results[0]["optimizer_state"]
    assert len(set(whole)) == 1, "without sharding every rank keeps the whole state"
    for strategy, result in zip(strategies[1:], results[1:]):
        sharded = result["optimizer_state"]
        for per_rank in sharded:
            assert 0.2 < per_rank / whole[0] < 0.3, (strategy, per_rank, whole[0])
        assert abs(sum(sharded) - whole[0]) <= 0.02 * whole[0], f"{strategy}: the shards add up to the whole state"


def test_variable_length_cuts_are_the_same_in_every_layout(tmp_path):
    """--difflm-varilen-prob: DP=2 (and TP=2+SP x DP=2) equal one process accumulating two
    micro-batches, because a cut is keyed by the micro-batch's place in the global batch."""
    from megatron.core.models.difflm.diffusion import varilen_length
    from megatron.core.transformer.transformer_config import DLMConfig
    from tests.distributed.parity import run_many

    argv = ARGV + ["--model-running-mode", "difflm-noshift", "--difflm-varilen-prob", "0.5",
                   "--global-batch-size", "4", "--train-iters", "4"]
    cuts = [varilen_length(DLMConfig(varilen_prob=0.5, seed=1234), it, pos, 32, 8) < 32
            for it in range(4) for pos in (0, 2)]
    assert any(cuts) and not all(cuts), "the seed must cut some micro-batches and not others"
    reference = run(1, argv, tmp_path, "single")
    data_parallel, composed = run_many(2, [argv], tmp_path, "dp2") + run_many(
        4, [argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]], tmp_path, "tp2_sp_dp2")
    assert reference["microbatches"] == 2 and data_parallel["microbatches"] == 1
    assert_same_training(reference, data_parallel, by_name=True)
    assert_same_training(reference, composed)
