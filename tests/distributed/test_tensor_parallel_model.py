"""Tensor (+ sequence) parallelism: the masked-only loss, dropout streams, recompute and
sharded data parallelism under tp. The layout x configuration matrix is test_layout_matrix.py.
"""

import pytest
import torch

from tests.distributed.parity import TINY_GQA, assert_same_training, run, start_workers

pytestmark = pytest.mark.distributed

ARGV = TINY_GQA + ["--micro-batch-size", "2", "--global-batch-size", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]

# layout: (world size, model flags shared with the reference, parallel flags)
LAYOUTS = {
    "tp2_tied": (2, [], ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, UNTIED, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp4_two_kv_heads": (4, UNTIED, ["--tensor-model-parallel-size", "4"]),
    "tp2_sp_dp2_tied": (4, [], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("layout,mode,fused", [("tp2_tied", "difflm-noshift", []),
                                               ("tp2_sp", "difflm-shift", ["--difflm-compile-loss"])])
def test_masked_only_loss_under_tensor_parallel_matches_full_logits_in_one_process(layout, mode, fused, tmp_path):
    """The chunked vocab-parallel output layer + cross-entropy at the masked positions only (chunks
    of 16 tokens, vocabulary padded 121 -> 128) against one process computing every logit; with
    --difflm-compile-loss too (fp32 on CPU: the eager passes; test_vocab_parallel_fused_loss.py has
    the Triton kernels over tp ranks)."""
    world_size, model_flags, parallel_flags = LAYOUTS[layout]
    argv = ARGV + model_flags + ["--model-running-mode", mode]
    masked_only = ["--difflm-masked-only-loss", "--difflm-loss-chunk-size", "16"] + fused
    assert_same_training(run(1, argv, tmp_path, "reference"),
                         run(world_size, argv + parallel_flags + masked_only, tmp_path, layout))


def _dropout_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(3)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, vocab_size=64, attention_dropout=0.3, hidden_dropout=0.3,
                               attention_backend="math", tensor_model_parallel_size=2)
    model = GPTModel(config, DLMConfig(mask_token_id=63), pg=state.groups).train()
    ids = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    attention_masks = []
    with model.rng_tracker.fork():
        attention_masks.append(torch.rand(8))
    torch.save({"logits": model(ids).detach(), "stream": attention_masks[0]}, f"{out}.{rank}")


def test_dropout_agrees_outside_and_differs_inside_tensor_parallel_regions(tmp_path):

    from tests.distributed.parity import free_port

    out = str(tmp_path / "dropout")
    start_workers(_dropout_worker, (free_port(), out), 2)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    # Hidden dropout acts on replicated activations: the same mask on both ranks keeps them equal.
    torch.testing.assert_close(rank0["logits"], rank1["logits"])
    assert not torch.equal(rank0["stream"], rank1["stream"]), "the tp stream differs per rank"


def test_tensor_parallel_composes_with_sharded_data_parallel(tmp_path):
    """TP=2 x DP=2 with the optimizer (ZeRO-1) or everything (FSDP2) sharded over the replicas:
    the same losses and global gradient norms as one process (both trained in one set of processes)."""
    from tests.distributed.parity import run_many

    argv = ARGV + ["--model-running-mode", "difflm-noshift"]
    reference = run(1, argv, tmp_path, "reference")
    strategies = ["optim", "optim_grads_params"]
    runs = run_many(4, [argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--data-parallel-sharding-strategy", strategy] for strategy in strategies],
                    tmp_path, "sharded")
    for strategy, parallel in zip(strategies, runs):
        for key in ("losses", "norms"):
            for single, multi in zip(reference[key], parallel[key]):
                assert abs(multi - single) <= 1e-5 * abs(single), (strategy, key, reference[key], parallel[key])


def _recompute_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    ids = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (dict(), dict(recompute_granularity="selective"),
                      dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)):
        torch.manual_seed(3)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=64, vocab_size=64, attention_dropout=0.3, hidden_dropout=0.3,
                                   attention_backend="math", tensor_model_parallel_size=2, sequence_parallel=True,
                                   **recompute)
        model = GPTModel(config, DLMConfig(mask_token_id=63), pg=state.groups).train()
        for _ in range(2):  # the second micro-batch must not reuse the first one's masks
            _, loss = model(ids, labels=ids)
            loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    torch.save(grads, f"{out}.{rank}")


def test_recompute_replays_tensor_parallel_dropout(tmp_path):

    from tests.distributed.parity import free_port

    out = str(tmp_path / "recompute")
    start_workers(_recompute_worker, (free_port(), out), 2)
    for rank in range(2):
        plain, selective, full = torch.load(f"{out}.{rank}")
        for name, grad in plain.items():
            torch.testing.assert_close(selective[name], grad, rtol=1e-6, atol=1e-7, msg=f"selective {name}")
            torch.testing.assert_close(full[name], grad, rtol=1e-6, atol=1e-7, msg=f"full {name}")
