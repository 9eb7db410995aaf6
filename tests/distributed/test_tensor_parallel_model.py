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
    from tests.distributed.dropout_masks import recorded_masks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    ids = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(3)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=64, vocab_size=64, attention_dropout=0.3, hidden_dropout=0.3,
                                   attention_backend="math", sequence_parallel=sequence_parallel)
        model = GPTModel(config, DLMConfig(mask_token_id=63), pg=state.groups).train()
        residual = []  # each layer's output: the residual stream, before any gather
        hooks = [layer.register_forward_hook(lambda _, __, output: residual.append(output.detach().clone()))
                 for layer in model.decoder.layers.values()]
        with recorded_masks() as masks:
            model(ids)
        for hook in hooks:
            hook.remove()
        runs[sequence_parallel] = {"masks": masks, "residual": residual}
    torch.save(runs, f"{out}.{rank}")


def test_dropout_masks_agree_on_replicated_activations_and_differ_on_split_ones(tmp_path):
    """Compared before any gather, rank by rank. Without sequence parallelism the residual stream is
    replicated: the embedding's and every layer's hidden dropout draw one mask on both tp ranks and the
    layers' outputs stay equal; the attention probabilities are split by heads and draw different masks.
    With sequence parallelism each rank holds other tokens: no mask repeats across the ranks."""
    from tests.distributed.dropout_masks import shared_masks
    from tests.distributed.parity import free_port

    out = str(tmp_path / "dropout")
    start_workers(_dropout_worker, (free_port(), out), 2)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    replicated, split = (rank0[False], rank1[False]), (rank0[True], rank1[True])
    hidden = [mask.dim() == 3 for mask in replicated[0]["masks"]]  # [s, b, h]; attention's are [b, n, s, s]
    assert sum(hidden) == 1 + 2 * 2 and len(hidden) - sum(hidden) == 2, "embedding, 2 x 2 residual, 2 attention"
    for index, is_hidden in enumerate(hidden):
        same = torch.equal(replicated[0]["masks"][index], replicated[1]["masks"][index])
        assert same == is_hidden, f"dropout call {index}: {'hidden' if is_hidden else 'attention'} masks"
    for layer, output in enumerate(replicated[0]["residual"]):
        torch.testing.assert_close(replicated[1]["residual"][layer], output, rtol=0, atol=0)
    assert len(split[0]["masks"]) == len(hidden)
    assert shared_masks(split[0]["masks"], split[1]["masks"]) == [], "sequence-parallel ranks repeat a mask"


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
                                   attention_backend="math", sequence_parallel=True,
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
