"""Run the real training entry point in N gloo processes and collect what parity tests compare.

`run(world_size, argv, tmp_path, name)` trains with `build_trainer` in `world_size` spawned
processes (`run_many`: several configurations, one after the other, in the same processes)
and returns the per-step losses and grad norms of rank 0 and, after step 1, every gradient
assembled to its full, layout-independent shape from all ranks' sharded descriptions (the
same `sharded_state_dict` checkpoints use).
"""

import importlib
import os
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.dist_checkpointing.model_state import bind, parameter_pieces
from megatron.core.distributed.data_parallel import unwrap
from megatron.core.optimizer.optimizer import local_optimizers
from megatron.core.pipeline_parallel.chunks import model_chunks
from megatron.core.tensor_parallel.utils import local_tensor
from megatron.training.initialize import initialize_distributed
from megatron.training.run_config import parse_run_config
from megatron.training.checkpointing import load_checkpoint
from megatron.training.training import build_trainer

TINY_GQA = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
            "--qk-layernorm", "--disable-bias-linear", "--seq-length", "32", "--mock-data", "--vocab-size", "120",
            "--add-mask-token", "--make-vocab-size-divisible-by", "32", "--lr", "1e-3", "--log-interval", "1000",
            "--eval-iters", "0", "--attention-backend", "math", "--train-iters", "3",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


# Workers start from a fork server that has imported torch, torch._dynamo (the first AdamW imports
# it: 2.5 s) and the training entry point once, not from a fresh interpreter each (spawn): about
# 4 s less per process. Workers set their own environment (ranks, ports), so the server's
# environment being the one it started with is fine.
mp.set_forkserver_preload(["torch", "torch._dynamo", "pretrain_difflm"])


def start_workers(worker, args: tuple, nprocs: int) -> None:
    """Run `worker(rank, *args)` in `nprocs` processes and wait for all of them."""
    mp.start_processes(_torn_down, args=(worker, *args), nprocs=nprocs, join=True, start_method="forkserver")


def _torn_down(rank: int, worker, *args) -> None:
    """`worker`, then every rank leaves its process group together: a rank that exits early would
    take the store (rank 0 serves it) away from peers still creating groups."""
    import torch.distributed as dist

    from tests.cpu_compile import use_test_backend

    use_test_backend()  # as in the test process (conftest.py): aot_eager without CUDA
    worker(rank, *args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _entry_worker(rank: int, world: int, port: int, argv: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    with open(f"{out}.console.{rank}", "w") as console:  # what torchrun would show of this rank
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(console.fileno(), 1), os.dup2(console.fileno(), 2)
        trainer = pretrain_difflm.main(argv)
        sys.stdout.flush(), sys.stderr.flush()
    first = trainer.state.iteration - len(trainer.history) + 1
    if rank == 0:  # each step's `lm loss` as the console prints it (with --log-interval 1)
        torch.save({first + i: float(f"{result.loss:E}") for i, result in enumerate(trainer.history)}, out)


def run_entry_point(nproc: int, argv: list, console: bool = False):
    """`torchrun --nproc_per_node nproc pretrain_difflm.py argv` (the whole entry: flags, lock, load,
    training, save), in workers from the fork server; returns {iteration: lm loss} of rank 0, and
    with `console` also the ranks' output, rank by rank. tests/distributed/test_pretrain_cli.py
    runs the entry through torchrun itself."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "losses.pt")
        try:
            start_workers(_entry_worker, (nproc, free_port(), list(argv), out), nproc)
        except Exception:  # the ranks' last words, as torchrun would have shown them
            for rank in range(nproc):
                path = Path(f"{out}.console.{rank}")
                print(f"--- rank {rank} ---\n" + (path.read_text()[-3000:] if path.exists() else ""))
            raise
        losses = torch.load(out)
        if not console:
            return losses
        return losses, "".join(Path(f"{out}.console.{rank}").read_text() for rank in range(nproc))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def full_gradients(model: torch.nn.Module) -> dict:
    """Every gradient by parameter name, gathered over the data-parallel shards (FSDP2's
    `full_tensor`, a collective: every rank calls it); this rank's tp slice stays a slice."""
    result = {}
    named = [item for chunk in model_chunks(model) for item in unwrap(chunk).named_parameters()]
    for name, param in named:
        if param.grad is not None:
            grad = param.grad
            result[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.detach().clone()
    return result


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the optimizer state tensors this rank holds (its shard under ZeRO-1 or FSDP2)."""
    states = [state for part in local_optimizers(optimizer) for state in part.state.values()]
    return sum(local_tensor(value).numel() for state in states for value in state.values()
               if isinstance(value, torch.Tensor))


def _train_and_capture(argv: list, runtime, entry: str = "pretrain_difflm") -> dict:
    """Train `argv` with the providers and forward step of module `entry` (pretrain_difflm, or a suite's own
    entry: its `extra_args_provider`, default add_difflm_args) and capture what the suites compare."""
    module = pretrain_difflm if entry == "pretrain_difflm" else importlib.import_module(entry)
    config = parse_run_config(argv, getattr(module, "extra_args_provider", add_difflm_args))
    trainer = build_trainer(config, runtime, module.train_valid_test_datasets_provider, module.model_provider,
                            module.forward_step)
    if config.checkpoint.load:  # as pretrain() starts: from the checkpoint's weights
        load_checkpoint(config.checkpoint, config.record, trainer)
    model, shards, named, step = unwrap(trainer.model), {}, {}, trainer.optimizer.step

    def capturing_step(*a, **k):
        if not named:
            named.update(full_gradients(trainer.model))  # a collective under FSDP2: every rank calls it
            pairs, _ = parameter_pieces(model, prefix="")  # the checkpoint's description of each weight
            for param, piece in pairs:  # bound to its gradient: this rank's boxes, FSDP2 shards included
                for shard in bind(piece, param.grad):
                    shards[f"{shard.key}@{shard.global_offset}"] = (shard.key, shard.data.clone(), shard.global_shape,
                                                                    shard.global_offset)
        return step(*a, **k)

    trainer.optimizer.step = capturing_step
    trainer.train()
    return {"losses": [r.loss for r in trainer.history], "norms": [r.grad_norm for r in trainer.history],
            "parts": [r.parts for r in trainer.history], "microbatches": config.training.num_microbatches,
            "shards": shards, "named": named,
            "optimizer_state": optimizer_state_numel(trainer.optimizer),
            "float8_layers": sum(isinstance(module, Float8Gemm) for module in model.modules())}


def _worker(rank: int, world_size: int, port: int, argvs: list, out_path: str, entry: str = "pretrain_difflm") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    runtime = initialize_distributed("gloo")
    # One process group serves every configuration: spawning costs more than a tiny training.
    torch.save([_train_and_capture(argv, runtime, entry) for argv in argvs], f"{out_path}.{rank}")


def _assemble(result: dict) -> dict:
    full = {}
    for key, data, shape, offset in result["shards"].values():
        tensor = full.setdefault(key, torch.full(shape, float("nan")))
        tensor[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data
    return full


def run_many(world_size: int, argvs: list, tmp_path, name: str, entry: str = "pretrain_difflm") -> list:
    """`run` for several configurations, trained one after the other in the same processes."""
    out = str(tmp_path / name)
    start_workers(_worker, (world_size, free_port(), argvs, out, entry), world_size)
    per_rank = [torch.load(f"{out}.{rank}") for rank in range(world_size)]
    results = []
    for index in range(len(argvs)):
        ranks = [runs[index] for runs in per_rank]
        # By name: each rank's gradients gathered over its replicas; pipeline stages hold different names.
        named = {name: grad for rank in ranks for name, grad in rank["named"].items()}
        results.append({"losses": ranks[0]["losses"], "norms": ranks[0]["norms"], "parts": ranks[0]["parts"],
                        "named": named,
                        "microbatches": ranks[0]["microbatches"],
                        "float8_layers": [rank["float8_layers"] for rank in ranks],
                        "grads": _assemble({"shards": {f"{r}/{k}": v for r, rank in enumerate(ranks)
                                                       for k, v in rank["shards"].items()}}),
                        "optimizer_state": [rank["optimizer_state"] for rank in ranks]})
    return results


def run(world_size: int, argv: list, tmp_path, name: str, entry: str = "pretrain_difflm") -> dict:
    return run_many(world_size, [argv], tmp_path, name, entry)[0]


def assert_same_training(reference: dict, parallel: dict, by_name: bool = False) -> None:
    """Per-step losses (and the terms of a loss of several: the joint AR + DLM objective's) to 1e-5
    relative; every step-1 gradient to 1e-5 relative of its scale.

    Gradients are compared as assembled global tensors, or by parameter name (`by_name`,
    for data-parallel sharding where each rank's gradients are gathered over the replicas).
    """
    assert len(reference["losses"]) == len(parallel["losses"]) > 0
    for single, multi in zip(reference["losses"], parallel["losses"]):
        assert abs(multi - single) <= 1e-5 * abs(single), (reference["losses"], parallel["losses"])
    for single, multi in zip(reference.get("parts", ()), parallel.get("parts", ())):
        assert single.keys() == multi.keys(), (single, multi)
        for name, value in single.items():
            assert abs(multi[name] - value) <= 1e-5 * abs(value), (name, reference["parts"], parallel["parts"])
    expected, actual = (reference["named"], parallel["named"]) if by_name else (reference["grads"], parallel["grads"])
    assert set(actual) == set(expected) and expected
    for key, grad in expected.items():
        assembled = actual[key]
        assert not assembled.isnan().any(), f"{key}: some part of the tensor was not covered by any rank"
        scale = grad.abs().max().item()
        torch.testing.assert_close(assembled, grad, rtol=1e-5, atol=1e-6 * scale, msg=key)


class LayoutCases:
    """A parity suite: `layouts` {name: (world size, parallel flags, cases, compare gradients by name)},
    each case a (config, mode, extra flags) tuple that `argv_of` turns into a command line. The
    single-process references are trained once for every case any layout uses; every layout of a
    world size trains in one set of processes (each configuration builds its own groups), since
    spawning costs more than a tiny training."""

    def __init__(self, layouts: dict, argv_of, entry: str = "pretrain_difflm"):
        self.layouts, self.argv_of, self.entry = layouts, argv_of, entry
        self.cases = list(dict.fromkeys(case for _, _, cases, _ in layouts.values() for case in cases))

    def world_sizes(self) -> list:
        return sorted({spec[0] for spec in self.layouts.values()})

    def references(self, tmp_path) -> dict:
        argvs = [self.argv_of(*case) for case in self.cases]
        return dict(zip(self.cases, run_many(1, argvs, tmp_path, "reference", self.entry)))

    def references_fixture(self):
        """A module-scoped pytest fixture training every case once in one process: a suite's test
        module assigns it to `references` and its tests take `references` as an argument."""
        @pytest.fixture(scope="module")
        def references(tmp_path_factory):
            return self.references(tmp_path_factory.mktemp("reference"))

        return references

    def check(self, world_size: int, references: dict, tmp_path) -> dict:
        """Train every case of every layout of `world_size` processes; each must match its reference.
        Returns {layout: [result per case]}."""
        runs = [(name, case) for name, (size, _, cases, _) in self.layouts.items() if size == world_size
                for case in cases]
        argvs = [self.argv_of(*case) + self.layouts[name][1] for name, case in runs]
        results, by_layout = run_many(world_size, argvs, tmp_path, f"world{world_size}", self.entry), {}
        for (name, case), result in zip(runs, results):
            by_layout.setdefault(name, []).append(result)
            try:
                assert_same_training(references[case], result, by_name=self.layouts[name][3])
            except AssertionError as error:
                raise AssertionError(f"{name} {case[:2]} {case[2]}: {error}") from None
        return by_layout


def tp_sp_and_dp(cases: list, argv_of) -> LayoutCases:
    """The two layouts every feature proves itself under: TP=2 with sequence parallelism, and DP=2
    (gradients compared by name), each case against one process."""
    return LayoutCases({"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], cases, False),
                        "dp2": (2, [], cases, True)}, argv_of)
