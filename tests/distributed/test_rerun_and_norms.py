"""Under tensor parallelism (2 gloo processes): --log-params-norm and --log-num-zeros-in-grad count
every element once (checked against the full tensors assembled from the checkpoint's description
of each shard), and a re-run of every step (injected transient errors, dropout on) keeps the ranks
in step: every rank reaches the same verdicts."""

import math
import os

import pytest
import torch

from tests.distributed.parity import TINY_GQA, free_port, start_workers

pytestmark = pytest.mark.distributed

ARGV = TINY_GQA + ["--tensor-model-parallel-size", "2", "--train-iters", "2", "--log-interval", "1",
                   "--log-params-norm", "--log-num-zeros-in-grad", "--hidden-dropout", "0.1",
                   "--error-injection-rate", "1", "--error-injection-type", "transient_error"]


def _worker(rank: int, port: int, out: str) -> None:
    import pretrain_difflm
    from custom_args.difflm import add_difflm_args
    from megatron.core.dist_checkpointing.model_state import bind, parameter_pieces
    from megatron.core.distributed.data_parallel import unwrap
    from megatron.training.initialize import initialize_distributed
    from megatron.training.run_config import parse_run_config
    from megatron.training.training import build_trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    runtime = initialize_distributed("gloo")
    trainer = build_trainer(parse_run_config(ARGV, add_difflm_args), runtime,
                            pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                            pretrain_difflm.forward_step)
    trainer.train()
    pieces = {}
    pairs, _ = parameter_pieces(unwrap(trainer.model), prefix="")
    for param, piece in pairs:
        for kind, tensor in (("param", param.detach()), ("grad", param.grad)):
            for shard in bind(piece, tensor):
                pieces[(kind, shard.key, tuple(shard.global_offset))] = (shard.data.clone(), tuple(shard.global_shape))
    numerics = trainer.history[-1].numerics
    torch.save({"params_norm": numerics.params_norm, "num_zeros": numerics.num_zeros, "pieces": pieces,
                "verdicts": (trainer.rerun.transient_errors, trainer.rerun.reproducible_errors),
                "losses": [r.loss for r in trainer.history]}, f"{out}.{rank}")


def test_params_norm_and_zero_count_under_tensor_parallel(tmp_path):
    out = str(tmp_path / "numerics")
    start_workers(_worker, (free_port(), out), 2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    full = {}
    for rank in ranks:  # a replicated weight's copies land on the same place: counted once
        for (kind, key, offset), (data, shape) in rank["pieces"].items():
            tensor = full.setdefault((kind, key), torch.full(shape, math.nan, dtype=torch.float64))
            tensor[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data.double()
    assert not any(tensor.isnan().any() for tensor in full.values())
    params_norm = math.sqrt(sum(float(t.square().sum()) for (kind, _), t in full.items() if kind == "param"))
    zeros = sum(int((t == 0).sum()) for (kind, _), t in full.items() if kind == "grad")
    for rank in ranks:
        assert rank["params_norm"] == pytest.approx(params_norm, rel=1e-6)
        assert rank["num_zeros"] == zeros > 0
        assert rank["verdicts"] == (2, 0) and rank["losses"] == ranks[0]["losses"]
