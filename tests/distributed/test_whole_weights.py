"""FSDP2's weights gathered for inference (data_parallel.whole_weights): inside it each rank may run its own
number of forwards (RL replicas sampling to different lengths: an all-gather per forward would hang), the
logits equal the unsharded model's, and after it the weights are shards again and training goes on."""

import os

import pytest
import torch

from tests.distributed.parity import free_port, start_workers

pytestmark = pytest.mark.distributed


def _model():
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
                               attention_backend="math", init_method_std=0.5)
    return GPTModel(config, DLMConfig(model_running_mode="vanilla")).eval()


def _logits(model, rows: int) -> torch.Tensor:
    ids = torch.arange(rows * 6).view(rows, 6) % 60
    positions = torch.arange(6).expand(rows, 6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(rows, 6, 6)
    return model.inference_forward(ids, positions, causal, None, 0)


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron.core.distributed.data_parallel import wrap_data_parallel, whole_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = wrap_data_parallel(_model(), torch.device("cpu"), dist.group.WORLD, "optim_grads_params")
    shard = next(model.parameters()).to_local().numel()
    with torch.no_grad(), whole_weights(model):
        logits = [_logits(model, rows) for rows in range(1, 2 + 2 * rank)]  # rank 0: 1 forward, rank 1: 3
        whole = next(model.parameters()).numel()
    model.train()
    loss = model(torch.arange(12).view(2, 6) % 60).float().mean()  # the training forward's gathers still pair up
    loss.backward()
    torch.save({"logits": logits, "shard": shard, "whole": whole,
                "after": next(model.parameters()).to_local().numel(), "loss": float(loss)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_each_rank_runs_its_own_forwards_on_whole_weights(tmp_path):
    out = str(tmp_path / "whole")
    start_workers(_worker, (free_port(), out), 2)
    reference = _model()
    with torch.no_grad():
        expected = [_logits(reference, rows) for rows in (1, 2, 3)]
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        for logits, want in zip(got["logits"], expected):
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert len(got["logits"]) == 1 + 2 * rank
        assert got["shard"] < got["whole"] and got["after"] == got["shard"], got
