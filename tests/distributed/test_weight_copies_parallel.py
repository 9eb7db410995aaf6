"""--cache-low-precision-weights on gloo: a bf16 run with the copies trains the same losses as one
without, under ZeRO-1 (each rank's compiled step writes its own shard's copies; the shards the other
ranks broadcast move no version counter, so they must be re-cast) and under TP=2 with sequence
parallelism, and with two pipeline stages, in Megatron's default configuration and the Llama style, DLM
and AR, with and without the masked-only loss (whose chunked output layer reads a copy of its weight);
float8 copies under ZeRO-1, TP=2 with sequence parallelism and CP=2 and, with delayed scaling, two
pipeline stages; delayed scaling's amaxes shared over the replicas and the tensor-parallel peers."""

import pytest

from tests.distributed.parity import run_many
from tests.distributed.test_layout_matrix import CONFIGS, MODES, SHAPE, TP2_SP

pytestmark = pytest.mark.distributed

MASKED_ONLY = ["--difflm-masked-only-loss"]  # the chunked loss reads the output weight's copy too
CASES = [  # (layout flags, config, mode, optimizer and loss flags)
    (["--use-distributed-optimizer"], "llama", "dlm", ["--compile-optimizer-step"] + MASKED_ONLY),
    (["--use-distributed-optimizer"], "megatron", "ar", ["--compile-optimizer-step"]),
    (TP2_SP, "megatron", "dlm", MASKED_ONLY),  # tied, the vocabulary split over the ranks
    (TP2_SP, "llama", "ar", MASKED_ONLY),  # untied, split (the compiled step's writes: ZeRO-1 and PP; CPU compiles)
    # the 7B script's pipeline; tied, so the last stage's copy of the word embedding is the output weight
    (["--pipeline-model-parallel-size", "2"], "megatron", "dlm", ["--compile-optimizer-step"] + MASKED_ONLY),
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


FLOAT8_CASES = [("llama", "dlm"), ("megatron", "ar")]  # each against bf16: test_float8_weight_copies.py


def test_float8_copies_train_under_zero1_as_replicated(tmp_path):
    """Under --fp8-format the copies are float8, cast by every rank's refresh with each weight's own amax:
    ZeRO-1 (each rank steps its shard, the rest arrives by broadcast) trains the losses of the replicated
    run to the bit. A rank that kept a broadcast shard's old copy would not."""
    argvs = []
    for config, mode in FLOAT8_CASES:
        base = (SHAPE + CONFIGS[config] + MODES[mode] + ["--compile-optimizer-step", "--bf16", "--lr", "1e-2",
                                                         "--fp8-format", "hybrid", "--cache-low-precision-weights"])
        argvs += [base, base + ["--use-distributed-optimizer"]]
    delayed = ["--fp8-recipe", "delayed"]  # the replicas' shared amaxes: the same scales on every rank
    argvs += [argv + delayed for argv in argvs]
    results = run_many(2, argvs, tmp_path, "float8_copies")
    for index, case in enumerate(FLOAT8_CASES + [case + ("delayed",) for case in FLOAT8_CASES]):
        replicated, zero1 = results[2 * index], results[2 * index + 1]
        assert len(replicated["losses"]) == 3
        assert zero1["losses"] == replicated["losses"], case
    for index in range(len(FLOAT8_CASES)):  # delayed scaling ran: its first step is tensorwise, later ones not
        tensorwise, delayed_run = results[2 * index]["losses"], results[2 * (index + len(FLOAT8_CASES))]["losses"]
        assert tensorwise[0] == delayed_run[0] and tensorwise[1:] != delayed_run[1:]


def test_delayed_scaling_under_pipeline_parallelism_trains_as_one_process(tmp_path):
    """--fp8-recipe delayed with two pipeline stages and four micro-batches (1F1B: several forwards before
    their backwards, so the running amaxes move between a layer's forward and its backward): each stage
    records and scales its own layers as one process does, losses and gradients, in the Llama style (DLM)
    and Megatron's default configuration (AR); and delayed scaling ran (after step 1 it is not tensorwise)."""
    from tests.distributed.parity import assert_same_training

    float8 = ["--bf16", "--lr", "1e-2", "--fp8-format", "hybrid", "--cache-low-precision-weights",
              "--global-batch-size", "8"]
    argvs = [SHAPE + CONFIGS[config] + MODES[mode] + float8 + recipe
             for config, mode in FLOAT8_CASES for recipe in (["--fp8-recipe", "delayed"], [])]
    single = run_many(1, argvs, tmp_path, "one_stage")
    pipelined = run_many(2, [argv + ["--pipeline-model-parallel-size", "2"] for argv in argvs[::2]], tmp_path, "pp2")
    for index, case in enumerate(FLOAT8_CASES):
        delayed, tensorwise = single[2 * index], single[2 * index + 1]
        assert_same_training(delayed, pipelined[index], by_name=True)
        assert delayed["losses"][0] == tensorwise["losses"][0] and delayed["losses"][1:] != tensorwise["losses"][1:]


CP2 = ["--context-parallel-size", "2"]
SPLIT_FLOAT8_CASES = [  # (layout, config, mode, extra flags): each against one process
    (TP2_SP, "llama", "dlm", MASKED_ONLY),  # the vocabulary-parallel output layer reading its bf16 copy
    (TP2_SP, "megatron", "ar", []),
    (TP2_SP, "megatron", "dlm", ["--fp8-recipe", "delayed"]),
    (TP2_SP, "llama", "ar", ["--fp8-recipe", "delayed"]),  # the fused float8 MLP (float8_mlp.py), delayed
    (CP2, "llama", "dlm", []),
    (CP2, "megatron", "ar", ["--fp8-recipe", "delayed"]),
]


def test_float8_copies_under_tensor_sequence_and_context_parallelism_track_one_process(tmp_path):
    """TP=2 with sequence parallelism, or CP=2, under --fp8-format: each rank runs its shards' GEMMs in float8,
    scaling its weight shard, a row-parallel layer's input shard, a column-parallel layer's output-gradient
    shard and its own sequence chunk by their own amaxes (no collective), so the values differ from one
    process's within float8's rounding only: every step's loss within 2.5e-3 relative of the one-process
    fp8 run (a shard cast or scaled wrongly, or a rank's stale copy, moves it by more), with every decoder
    linear of both ranks in float8."""
    float8 = ["--bf16", "--lr", "1e-2", "--fp8-format", "hybrid"]  # the flag alone turns the copies on
    bases = [SHAPE + CONFIGS[config] + MODES[mode] + extra + float8 for _, config, mode, extra in SPLIT_FLOAT8_CASES]
    single = run_many(1, bases, tmp_path, "one_rank")
    parallel = run_many(2, [base + layout for base, (layout, *_) in zip(bases, SPLIT_FLOAT8_CASES)], tmp_path, "split")
    for index, case in enumerate(SPLIT_FLOAT8_CASES):
        fp8, split = single[index]["losses"], parallel[index]["losses"]
        assert len(split) == len(fp8) == 3
        for step, (one, two) in enumerate(zip(fp8, split)):
            assert abs(two - one) <= 2.5e-3 * abs(one), (case, step, fp8, split)
        assert parallel[index]["float8_layers"] == single[index]["float8_layers"] * 2 == [8, 8], case


def _shared_amax_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    from megatron.core.fp8.float8_copy import Float8Gemm
    from megatron.core.fp8.float8_matmul import GRADIENT_DTYPES
    from megatron.core.fp8.float8_scaling import DelayedScaling, DelayedScalingConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # As the trainer's: the replicas (ranks 0+2, 1+3), then the tensor-parallel peers (0+1, 2+3).
    replicas = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    peers = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    gemms = [Float8Gemm(torch.zeros(16, 16), GRADIENT_DTYPES["hybrid"]) for _ in range(2)]
    scaling = DelayedScaling(gemms, ["a", "b"], "hybrid", DelayedScalingConfig(), [replicas, peers])
    torch.manual_seed(rank)
    seen = torch.rand(2, 2) * (rank + 1)
    for gemm, row in zip(gemms, seen):
        gemm.amax.copy_(row)
    scaling.update()
    torch.save({"seen": seen, "history": scaling.history.clone(), "scales": scaling.scales.clone()}, f"{out}.{rank}")


def test_delayed_scaling_shares_the_largest_amax_over_replicas_and_tensor_parallel_peers(tmp_path):
    """--fp8-recipe delayed: every rank of a layer, its replicas and its tensor-parallel peers (which hold
    other shards of it), casts with the scales of the largest amax any of them saw (an all-reduce over
    each group in the update), so they agree and a checkpoint holds what each rank holds."""
    import torch

    from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, scale_of
    from tests.distributed.parity import free_port, start_workers

    out = str(tmp_path / "amax")
    start_workers(_shared_amax_worker, (4, free_port(), out), 4)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(4)]
    largest = torch.stack([rank["seen"] for rank in ranks]).amax(dim=0)
    assert all(not torch.equal(rank["seen"], largest) for rank in ranks[:3])  # no one group saw them all
    expected = torch.stack([torch.stack([scale_of(row[0], FORWARD_DTYPE), scale_of(row[1], GRADIENT_DTYPES["hybrid"])])
                            for row in largest])
    for rank in ranks:
        assert torch.equal(rank["history"][:, 0], largest)
        assert torch.equal(rank["scales"], expected)
