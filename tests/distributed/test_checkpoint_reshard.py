"""Checkpoints across layouts: identical logits after resharding, FSDP2 shards, async save.

Training runs are `pretrain_difflm.main` (the whole entry point: flags, checkpoint lock, load,
training, save) in gloo workers started from the fork server (tests/distributed/test_pretrain_cli.py
runs the same entry through torchrun); the logits of a fixed batch are computed by workers that
build the model under a layout and load the checkpoint the way `pretrain` does.
"""

import dataclasses
import os
import threading

import pytest
import torch
import torch.distributed as dist

from tests.distributed.parity import TINY_GQA, free_port, run_entry_point, start_workers
from tests.distributed.test_checkpoint_resume import checkpoint_at

pytestmark = pytest.mark.distributed

# Vocabulary 121 padded to a multiple of 48 x tp: 144 rows under tp=1, 192 under tp=2 and tp=4.
MODEL = [flag for flag in TINY_GQA if flag not in ("--train-iters", "3")] + [
    "--make-vocab-size-divisible-by", "48",
    "--micro-batch-size", "2", "--global-batch-size", "12", "--log-interval", "1", "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
TP2_DP2_ZERO1 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]


def torchrun(nproc: int, *flags: str, iters: int = 8) -> dict:
    return run_entry_point(nproc, [*MODEL, "--train-iters", str(iters), *flags])


def _logits_worker(rank: int, world: int, port: int, argv: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    config = parse_run_config(argv, add_difflm_args)
    trainer = build_trainer(config, initialize_distributed("gloo"), pretrain_difflm.train_valid_test_datasets_provider,
                            pretrain_difflm.model_provider, pretrain_difflm.forward_step)
    assert load_checkpoint(config.checkpoint, config.record, trainer) is not None
    trainer.model.eval()
    input_ids = torch.randint(0, 120, (3, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = trainer.model(input_ids)
    if rank == 0:
        torch.save(logits[..., :config.model.unpadded_vocab_size].clone(), out)
    dist.barrier()
    dist.destroy_process_group()


def logits_after_loading(tmp_path, nproc: int, layout: list, checkpoint: str) -> torch.Tensor:
    out = str(tmp_path / f"logits_{nproc}_{'_'.join(layout)}.pt")
    argv = [*MODEL, "--train-iters", "8", *layout, "--load", checkpoint]
    start_workers(_logits_worker, (nproc, free_port(), argv, out), nproc)
    return torch.load(out)


def test_tp2_dp2_zero1_checkpoint_gives_the_same_logits_and_training_under_tp1_and_tp4(tmp_path):
    """Weights and optimizer state saved under TP=2 x DP=2 (ZeRO-1); TP=4 splits the 2 kv heads'
    rows; the vocabulary padding differs between tp=1 and the others."""
    straight = torchrun(4, *TP2_DP2_ZERO1, "--save", str(tmp_path / "straight"), "--save-interval", "6")
    ckpt = str(checkpoint_at(tmp_path / "straight", 6, tmp_path / "ckpt"))
    # The one-process logits are the reference: a layout that failed to load would give the
    # (layout-independent) initial weights' logits instead, which training from the checkpoint
    # under TP=4 (its losses those of the uninterrupted run) rules out for the loaded weights.
    one_process = logits_after_loading(tmp_path, 1, [], ckpt)
    assert one_process.isfinite().all()
    tp4 = ["--tensor-model-parallel-size", "4"]
    torch.testing.assert_close(logits_after_loading(tmp_path, 4, tp4, ckpt), one_process, rtol=1e-5, atol=1e-5,
                               msg="logits under TP=4")
    resumed = torchrun(4, *tp4, "--load", ckpt)
    assert sorted(resumed) == [7, 8]
    for step in (7, 8):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


def test_fsdp2_async_checkpoint_resumes_bit_exactly_and_reshards_to_tensor_parallel(tmp_path):
    """ZeRO-3 over 3 ranks splits rows unevenly (a fused QKV row range crosses query groups);
    the saves (iterations 3, 6 and 8 of the uninterrupted run) are asynchronous."""
    fsdp = ["--data-parallel-sharding-strategy", "optim_grads_params"]
    straight = torchrun(3, *fsdp, "--save", str(tmp_path / "straight"), "--async-save", "--save-interval", "3")
    assert (tmp_path / "straight" / "latest_checkpointed_iteration.txt").read_text() == "8"
    ckpt = str(checkpoint_at(tmp_path / "straight", 6, tmp_path / "ckpt"))
    second = torchrun(3, *fsdp, "--load", ckpt)
    assert second == {7: straight[7], 8: straight[8]}, "lm loss must match the uninterrupted run"
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    torch.testing.assert_close(logits_after_loading(tmp_path, 2, tp2, ckpt),
                               logits_after_loading(tmp_path, 3, fsdp, ckpt), rtol=1e-5, atol=1e-5)
    resumed = torchrun(2, *tp2, "--load", ckpt)
    for step in (7, 8):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


def _async_worker(rank: int, world: int, port: int, argv: list, out: str) -> None:
    """Trains with a checkpoint writer that cannot finish until the loop has moved on."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    import pretrain_difflm
    from torch.distributed.checkpoint import FileSystemWriter
    from custom_args.difflm import add_difflm_args
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict
    from megatron.training.checkpointing import Checkpointer
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    config = parse_run_config(argv, add_difflm_args)
    trainer = build_trainer(config, initialize_distributed("gloo"), pretrain_difflm.train_valid_test_datasets_provider,
                            pretrain_difflm.model_provider, pretrain_difflm.forward_step)
    trainer.checkpointer = Checkpointer(config.checkpoint, config.record, log=lambda line: events.append(line))
    events, next_step_started = [], threading.Event()
    write_data, train_step = FileSystemWriter.write_data, trainer.train_step

    def held_write(self, plan, planner):
        released = next_step_started.wait(timeout=120)
        events.append(f"writer released by the next step: {released}")
        return write_data(self, plan, planner)

    def observed_step(data_iterator):
        if trainer.checkpointer.pending is not None:
            events.append(f"step {trainer.state.iteration + 1} started while a save is in flight")
            next_step_started.set()
        return train_step(data_iterator)

    FileSystemWriter.write_data, trainer.train_step = held_write, observed_step
    trainer.train()
    # The final checkpoint holds the final weights.
    trained = model_sharded_state_dict(trainer.model)
    fresh = {name: dataclasses.replace(piece, data=torch.zeros_like(piece.data)) for name, piece in trained.items()}
    serialization.load(fresh, os.path.join(config.checkpoint.save, "iter_0000004"))
    differences = {name: (fresh[name].data - piece.data).abs().max().item() for name, piece in trained.items()}
    torch.save({"events": events, "differences": differences}, out)
    dist.destroy_process_group()


def test_async_save_lets_the_next_step_start_before_the_save_completes(tmp_path):
    ckpt, out = tmp_path / "ckpt", str(tmp_path / "async.pt")
    argv = [*MODEL, "--train-iters", "4", "--save", str(ckpt), "--async-save", "--save-interval", "2"]
    start_workers(_async_worker, (1, free_port(), argv, out), 1)
    result = torch.load(out)
    events = result["events"]
    started = events.index("step 3 started while a save is in flight")
    assert events.index("writer released by the next step: True") > started
    assert any(line.startswith(f"> saved {ckpt / 'iter_0000002'}") for line in events), events
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    differences = result["differences"]
    assert differences and all(value == 0.0 for value in differences.values()), differences


def test_fsdp2_zero2_resume_is_bit_exact(tmp_path):
    zero2 = ["--data-parallel-sharding-strategy", "optim_grads", "--model-running-mode", "vanilla"]
    straight = torchrun(2, *zero2, "--save", str(tmp_path / "straight"), "--save-interval", "3", iters=6)
    ckpt = str(checkpoint_at(tmp_path / "straight", 3, tmp_path / "ckpt"))
    second = torchrun(2, *zero2, "--load", ckpt, iters=6)
    assert sorted(second) == [4, 5, 6] and second == {step: straight[step] for step in (4, 5, 6)}
