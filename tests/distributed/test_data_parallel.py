"""Data parallelism on gloo equals one process with gradient accumulation, step for step."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.distributed.data_parallel import unwrap
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_distributed
from megatron.training.training import build_trainer

pytestmark = pytest.mark.distributed

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
        "--qk-layernorm", "--disable-bias-linear", "--seq-length", "32", "--mock-data", "--vocab-size", "60",
        "--add-mask-token", "--lr", "1e-3", "--log-interval", "1000", "--eval-iters", "0",
        "--attention-backend", "math", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--reset-attention-mask", "--reset-position-ids", "--difflm-t-sampling", "antithetic"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, argv: list, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    args = parse_args(argv, add_difflm_args)
    runtime = initialize_distributed("gloo")
    trainer = build_trainer(args, runtime, pretrain_difflm.train_valid_test_datasets_provider,
                            pretrain_difflm.model_provider, pretrain_difflm.forward_step)
    first_grads = {}
    step = trainer.optimizer.step

    def capturing_step(*a, **k):
        if not first_grads:
            first_grads.update({n: p.grad.clone() for n, p in unwrap(trainer.model).named_parameters()})
        return step(*a, **k)

    trainer.optimizer.step = capturing_step
    trainer.train()
    if rank == 0:
        torch.save({"losses": [r.loss for r in trainer.history], "grads": first_grads,
                    "microbatches": args.num_microbatches}, out_path)


def run(world_size: int, argv: list, tmp_path) -> dict:
    out = str(tmp_path / f"world{world_size}.pt")
    mp.start_processes(_worker, args=(world_size, free_port(), argv, out), nprocs=world_size, join=True,
                       start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("mode", ["difflm-noshift", "vanilla"])
def test_two_data_parallel_ranks_match_one_process(mode, tmp_path):
    argv = ARGV + ["--model-running-mode", mode]
    single, parallel = run(1, argv, tmp_path), run(2, argv, tmp_path)
    assert (single["microbatches"], parallel["microbatches"]) == (4, 2)
    assert len(single["losses"]) == 3
    for loss_single, loss_parallel in zip(single["losses"], parallel["losses"]):
        assert loss_parallel == pytest.approx(loss_single, rel=1e-5)
    for name, grad in single["grads"].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(parallel["grads"][name], grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
