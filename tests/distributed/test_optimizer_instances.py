"""Megatron's data-parallel flags on gloo: --num-distributed-optimizer-instances (ZeRO-1 and HSDP),
--grad-reduce-in-bf16, FSDP2's bf16 weights under --bf16, --ddp-bucket-size / --ddp-num-buckets
and --overlap-param-gather."""

import os
import shutil

import pytest
import torch

from tests.distributed.parity import (TINY_GQA, assert_same_training, free_port, full_gradients, run, run_many,
                                      start_workers)

pytestmark = pytest.mark.distributed

DP4 = TINY_GQA + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2"]
TWO_INSTANCES = ["--num-distributed-optimizer-instances", "2"]
ZERO1, FSDP2 = ["--use-distributed-optimizer"], ["--data-parallel-sharding-strategy", "optim_grads_params"]


def test_two_instances_of_four_replicas_match_one_process_and_hold_half_the_state(tmp_path):
    """ZeRO-1 and HSDP over 2 instances of 2 replicas: one process's training, each rank half the
    optimizer state (not a quarter: sharded within an instance; not all: sharded at all)."""
    single = run(1, DP4, tmp_path, "single")
    whole = single["optimizer_state"][0]
    for name, result in zip(("zero1", "hsdp"), run_many(4, [DP4 + ZERO1 + TWO_INSTANCES, DP4 + FSDP2 + TWO_INSTANCES],
                                                        tmp_path, "instances")):
        assert_same_training(single, result, by_name=True)
        assert result["norms"] == pytest.approx(single["norms"], rel=1e-5), "the norm counts every shard once"
        state = result["optimizer_state"]
        for per_rank in state:
            assert 0.35 < per_rank / whole < 0.65, (name, state, whole)
        for instance in (state[:2], state[2:]):  # ranks 0-1 and 2-3: each instance holds everything once
            assert abs(sum(instance) - whole) <= 0.02 * whole, (name, state, whole)


def test_the_compiled_optimizer_step_as_zero1_local_optimizer_matches_one_process(tmp_path):
    """--compile-optimizer-step under ZeRO-1 over 2 replicas: each rank updates its shard with the
    compiled step, the clip's scale folded into it, and the losses and norms of 4 iterations (so
    every update) are one process's, which are the uncompiled step's; half the state a rank."""
    dp2 = TINY_GQA + ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
                      "--compile-optimizer-step"]
    single, uncompiled = run_many(1, [dp2, dp2[:-1]], tmp_path, "single")
    zero1 = run(2, dp2 + ZERO1, tmp_path, "zero1")
    for result in (uncompiled, zero1):
        assert result["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert result["norms"] == pytest.approx(single["norms"], rel=1e-5)
    # Folded, the gradients stay as the backward left them: summed over one process's 2 micro-batches,
    # averaged over the 2 replicas. Every tensor the same up to that factor of 2.
    for name, grad in single["named"].items():
        torch.testing.assert_close(zero1["named"][name] * 2, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(),
                                   msg=name)
    whole = single["optimizer_state"][0]
    assert all(0.35 < per_rank / whole < 0.65 for per_rank in zero1["optimizer_state"]), zero1["optimizer_state"]


def _resume_worker(rank: int, world: int, port: int, argvs: list, root: str, out: str) -> None:
    """Per configuration: 3 iterations saving at 2, then iteration 2 loaded and trained to 3."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    import torch.distributed as dist
    from megatron.training.checkpointing import Checkpointer, load_checkpoint
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    runtime, results = initialize_distributed("gloo"), []

    def trainer_for(argv):
        config = parse_run_config(argv, add_difflm_args)
        trainer = build_trainer(config, runtime, pretrain_difflm.train_valid_test_datasets_provider,
                                pretrain_difflm.model_provider, pretrain_difflm.forward_step)
        return config, trainer

    for index, argv in enumerate(argvs):
        straight, resumed = os.path.join(root, f"straight{index}"), os.path.join(root, f"resumed{index}")
        config, trainer = trainer_for(argv + ["--train-iters", "3", "--save", straight, "--save-interval", "2"])
        trainer.checkpointer = Checkpointer(config.checkpoint, config.record, log=lambda line: None)
        trainer.train()
        if rank == 0:
            shutil.copytree(os.path.join(straight, "iter_0000002"), os.path.join(resumed, "iter_0000002"))
            with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as tracker:
                tracker.write("2")
        dist.barrier()
        config, second = trainer_for(argv + ["--train-iters", "3", "--load", resumed])
        assert load_checkpoint(config.checkpoint, config.record, second) == 2
        second.train()
        elements = sum(p.numel() for p in second.model.parameters())
        results.append({"straight": [r.loss for r in trainer.history], "resumed": [r.loss for r in second.history],
                        "bucket_bytes": getattr(second.model, "bucket_bytes_cap", None), "elements": elements})
    if rank == 0:
        torch.save(results, out)


def _stored_chunks(checkpoint: str) -> dict:
    """{optimizer key: (elements stored, elements of the tensor)} of a DCP checkpoint."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {key: (sum(math.prod(chunk.sizes) for chunk in meta.chunks), math.prod(meta.size))
            for key, meta in metadata.items() if key.startswith("optimizer.")}


def test_two_instances_save_each_optimizer_shard_once_and_resume_exactly(tmp_path):
    argvs = [DP4 + ZERO1 + TWO_INSTANCES + ["--ddp-num-buckets", "3"], DP4 + FSDP2 + TWO_INSTANCES]
    out = str(tmp_path / "resume.pt")
    start_workers(_resume_worker, (4, free_port(), argvs, str(tmp_path), out), 4)
    for index, result in enumerate(torch.load(out)):
        assert result["resumed"] == result["straight"][2:], (index, result)
        stored = _stored_chunks(str(tmp_path / f"straight{index}" / "iter_0000002"))
        assert stored and all(written == numel for written, numel in stored.values()), stored
    zero1 = torch.load(out)[0]
    assert zero1["bucket_bytes"] == zero1["elements"] // 3 * 4, "--ddp-num-buckets: a third of the elements each"


def test_instances_must_divide_the_replicas_and_need_a_distributed_optimizer(capsys):
    from custom_args.difflm import add_difflm_args
    from megatron.training.arguments import parse_args

    cases = [(ZERO1 + ["--num-distributed-optimizer-instances", "3"], "does not divide"),
             (TWO_INSTANCES, "--num-distributed-optimizer-instances has no effect without --use-distributed"),
             (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 has no effect without --bf16"),
             (FSDP2 + ["--ddp-bucket-size", "1000"], "--ddp-bucket-size has no effect"),
             (["--overlap-param-gather"], "--overlap-param-gather has no effect"),
             (["--ddp-bucket-size", "10", "--ddp-num-buckets", "2"], "only one of"),
             (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "contradict")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(DP4 + flags, add_difflm_args, world_size=4)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)


def _precision_worker(rank: int, world: int, port: int, argvs: list, out: str) -> None:
    """Per configuration: the losses, the step-1 gradients (whole, by name), the dtypes the
    layers' and the embedding's weights have in forward, and the wrappers' settings."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    from megatron.core.distributed.data_parallel import unwrap
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    runtime, results = initialize_distributed("gloo"), []
    for argv in argvs:
        trainer = build_trainer(parse_run_config(argv, add_difflm_args), runtime,
                                pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                                pretrain_difflm.forward_step)
        model, seen, grads, step = unwrap(trainer.model), {}, {}, trainer.optimizer.step
        layer = model.decoder.layers["0"] if "0" in model.decoder.layers else next(iter(model.decoder.layers.values()))
        layer.mlp.linear_fc1.register_forward_pre_hook(lambda m, a: seen.setdefault("layer", m.weight.dtype) and None)
        model.embedding.register_forward_pre_hook(
            lambda m, a: seen.setdefault("embedding", next(m.parameters()).dtype) and None)

        def capturing_step(*a, **k):
            if not grads:
                grads.update(full_gradients(trainer.model))
            return step(*a, **k)

        trainer.optimizer.step = capturing_step
        trainer.train()
        state = layer._get_fsdp_state() if hasattr(layer, "_get_fsdp_state") else None
        results.append({"losses": [r.loss for r in trainer.history], "grads": grads, "dtypes": seen,
                        "bucket_bytes": getattr(trainer.model, "bucket_bytes_cap", None),
                        "prefetch": None if state is None else len(state._states_to_forward_prefetch)})
    if rank == 0:
        torch.save(results, out)


BF16 = TINY_GQA + ["--model-running-mode", "vanilla", "--micro-batch-size", "1", "--global-batch-size", "4",
                   "--clip-grad", "0", "--bf16", "--train-iters", "2"]
ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads"]
REDUCE_BF16 = ["--grad-reduce-in-bf16"]


def _bf16_exact(grads: dict) -> bool:
    """Every gradient holds bf16 values only. (The step's scale, 2 replicas / 128 loss tokens, and
    the division by the replicas are powers of two, which keep a bf16 sum a bf16 value.)"""
    return all(torch.equal(grad, grad.bfloat16().float()) for grad in grads.values())


def test_bf16_weights_under_fsdp2_and_bf16_gradient_reduction(tmp_path):
    """--bf16 under FSDP2 computes the layers with gathered bf16 weights (the embedding keeps fp32,
    so the residual stream stays fp32), and trains as DDP's autocast does within bf16 rounding;
    --grad-reduce-in-bf16 sums bf16 gradients (DDP and FSDP2); --ddp-bucket-size sets DDP's buckets."""
    argvs = [BF16, BF16 + REDUCE_BF16 + ["--ddp-bucket-size", "5000"], BF16 + ZERO2,
             BF16 + ZERO2 + REDUCE_BF16 + ["--overlap-param-gather"]]
    out = str(tmp_path / "precision.pt")
    start_workers(_precision_worker, (2, free_port(), argvs, out), 2)
    ddp, ddp_bf16_reduce, fsdp, fsdp_bf16_reduce = torch.load(out)
    assert ddp["dtypes"] == {"layer": torch.float32, "embedding": torch.float32}
    assert fsdp["dtypes"] == fsdp_bf16_reduce["dtypes"] == {"layer": torch.bfloat16, "embedding": torch.float32}
    for single, multi in zip(ddp["losses"], fsdp["losses"]):
        assert abs(multi - single) <= 1e-2 * abs(single), (ddp["losses"], fsdp["losses"])
    assert not _bf16_exact(ddp["grads"]) and not _bf16_exact(fsdp["grads"]), "fp32 reductions keep fp32 sums"
    assert _bf16_exact(ddp_bf16_reduce["grads"]) and _bf16_exact(fsdp_bf16_reduce["grads"])
    for reference, result in ((ddp, ddp_bf16_reduce), (ddp, fsdp), (fsdp, fsdp_bf16_reduce)):
        for name, grad in reference["grads"].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(result["grads"][name], grad, rtol=2e-2, atol=2e-2 * scale, msg=name)
    assert (ddp["bucket_bytes"], ddp_bf16_reduce["bucket_bytes"]) == (25 * 2 ** 20, 5000 * 4)
    assert (fsdp["prefetch"], fsdp_bf16_reduce["prefetch"]) == (0, 1), "--overlap-param-gather: explicit prefetch"
