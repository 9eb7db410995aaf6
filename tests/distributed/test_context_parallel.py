"""Context parallelism equals one process: all-gather K/V attention over contiguous chunks
(bidirectional DLM, noshift and shift) and load-balanced 2C chunks (causal AR, block-causal,
sliding window), with packed documents crossing chunk boundaries and variable lengths, composed
with TP+SP, ZeRO-1, FSDP2 and PP.

Every loss and every step-1 gradient must match the single-process run to 1e-5 (gloo, fp32),
in Megatron's default configuration (biases, LayerNorm, GeLU, tied) and the Llama style.
"""

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.context_parallel import (COMM_TYPES, gather_keys_and_values, gathered_positions,
                                                        heads_to_sequence, load_balanced, sequence_to_heads,
                                                        shard_positions, whole_sequence_mask)
from tests.distributed.parity import LayoutCases, free_port, start_workers
from tests.distributed.test_layout_matrix import CONFIGS, GQA, MODES, SHAPE

pytestmark = pytest.mark.distributed

FOUR_LAYERS = [flag if flag != "2" or SHAPE[i - 1] != "--num-layers" else "4" for i, flag in enumerate(SHAPE)]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4"]
VARILEN = ("--difflm-varilen-prob", "0.5")
BLOCK = ("--attention-mask-type", "block_causal", "--difflm-block-size", "8")
WINDOW = ("--attention-mask-type", "sliding_window", "--sliding-window", "6")
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
A2A = ["--cp-comm-type", "a2a"]
ZERO2, FSDP2 = (["--data-parallel-sharding-strategy", strategy] for strategy in ("optim_grads", "optim_grads_params"))

SHIFT = ("--model-running-mode", "difflm-shift")
CASES = [("megatron", "dlm", ()), ("megatron", "ar", ()), ("llama", "dlm", ()), ("llama", "ar", ()),
         ("megatron", "dlm", VARILEN), ("llama", "dlm", BLOCK), ("megatron", "dlm", WINDOW), ("llama", "dlm", SHIFT),
         ("gpt3", "dlm", ()), ("gpt3", "ar", ())]
# layout: (world size, parallel flags, the cases it trains, gradients compared by name)
LAYOUTS = {
    "cp2": (2, CP2, [CASES[0], CASES[1], CASES[5], CASES[6], CASES[7], CASES[8], CASES[9]], False),
    "cp4": (4, CP4, [CASES[0], CASES[3], CASES[5]], False),
    "cp2_tp2_sp": (4, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   [CASES[0], CASES[1], CASES[4], CASES[8]], False),
    "cp2_dp2_zero1": (4, CP2 + ["--use-distributed-optimizer"], [CASES[2], CASES[1]], False),
    "cp2_pp2": (4, CP2 + ["--pipeline-model-parallel-size", "2"], [CASES[0], CASES[3]], False),
    "cp2_dp2_fsdp2": (4, CP2 + FSDP2, [CASES[7], CASES[3]], True),
    "cp2_a2a": (2, CP2 + A2A, [CASES[0], CASES[3], CASES[5]], False),
    "cp4_a2a": (4, CP4 + A2A, [CASES[1], CASES[6]], False),  # 1 query head per rank, the 2 kv heads replicated
    "cp2_a2a_tp2_sp": (4, CP2 + A2A + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                       [CASES[2], CASES[1]], False),
    # The other data-parallel strategies, and a2a with each kind of replica and with PP.
    "cp2_dp2": (4, CP2, [CASES[0]], False),
    "cp2_dp2_zero2": (4, CP2 + ZERO2, [CASES[1]], True),
    "cp2_a2a_dp2_zero1": (4, CP2 + A2A + ["--use-distributed-optimizer"], [CASES[3]], False),
    "cp2_a2a_dp2_fsdp2": (4, CP2 + A2A + FSDP2, [CASES[0]], True),
    "cp2_a2a_pp2": (4, CP2 + A2A + ["--pipeline-model-parallel-size", "2"], [CASES[1]], False),
}


def argv_of(config: str, mode: str, extra: tuple) -> list:
    """The case's command line; "megatron" here is Megatron's default configuration (biases, LayerNorm,
    GeLU, tied embeddings) with grouped-query attention (2 kv heads for 4 query heads), "gpt3" the same
    with the learned position table."""
    gqa = GQA if config in ("megatron", "gpt3") else []
    return FOUR_LAYERS + BATCH + gqa + CONFIGS[config] + MODES[mode] + list(extra)


SUITE = LayoutCases(LAYOUTS, argv_of)


references = SUITE.references_fixture()


@pytest.mark.parametrize("world_size", SUITE.world_sizes())
def test_context_parallel_layouts_match_one_process(world_size, references, tmp_path):
    """Every layout of LAYOUTS with `world_size` processes, each case against its single-process run."""
    assert SUITE.check(world_size, references, tmp_path)


def _attention_worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, results = dist.new_group(list(range(world_size))), {}
    q, k, v, grad_out, documents = _attention_inputs()
    for (name, (mask_type, block, window, packed)), comm in itertools.product(ATTENTION_CASES.items(), COMM_TYPES):
        balanced = load_balanced(mask_type)
        mine = shard_positions(SEQ, world_size, rank, balanced)
        keys = gathered_positions(SEQ, world_size, balanced)
        q_local, k_local, v_local = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        mask = AttentionMask(mask_type, block_size=block, window=window, document_ids=documents if packed else None,
                             query_positions=mine, key_positions=keys)
        if comm == "all_gather":
            output = core_attention(q_local, *gather_keys_and_values(k_local, v_local, group), mask, backend="sdpa")
        else:
            heads = sequence_to_heads(q_local, k_local, v_local, group)
            output = heads_to_sequence(core_attention(*heads, whole_sequence_mask(mask), backend="sdpa"), group)
        output.backward(grad_out[:, :, mine])
        results[name, comm] = (mine, output.detach(), q_local.grad, k_local.grad, v_local.grad)
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


SEQ = 256
ATTENTION_CASES = {"no_mask": ("no_mask", None, None, False), "no_mask_packed": ("no_mask", None, None, True),
                   "causal": ("causal", None, None, False), "causal_packed": ("causal", None, None, True),
                   "block_causal": ("block_causal", 16, None, False), "sliding_window": ("sliding_window", None, 40,
                                                                                          True)}


def _attention_inputs():
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, SEQ, 16, generator=generator)
    k, v = torch.randn(2, 2, SEQ, 16, generator=generator), torch.randn(2, 2, SEQ, 16, generator=generator)
    grad_out = torch.randn(2, 4, SEQ, 16, generator=generator)
    lengths = [[37, 100, 90, 29], [128, 3, 125]]  # documents that cross the chunk boundaries
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    return q, k, v, grad_out, documents


def test_context_parallel_attention_over_four_ranks_equals_full_attention(tmp_path):
    """Random q/k/v at seq 256 over 4 gloo ranks give the full attention's outputs and dq, and each
    rank's dk/dv equal the full gradients of its keys, for every mask type with and without packed
    documents, both ways: all-gathered K/V (reduce-scattered grads) and Ulysses all-to-all (4 query
    heads, 1 per rank; 2 kv heads, replicated to 4)."""
    out = str(tmp_path / "attention")
    start_workers(_attention_worker, (4, free_port(), out), 4)
    q, k, v, grad_out, documents = _attention_inputs()
    per_rank = [torch.load(f"{out}.{rank}") for rank in range(4)]
    for name, (mask_type, block, window, packed) in ATTENTION_CASES.items():
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = AttentionMask(mask_type, block_size=block, window=window, document_ids=documents if packed else None)
        expected = core_attention(*full, mask, backend="math")
        expected.backward(grad_out)
        for mine, output, dq, dk, dv in (ranks[name, comm] for ranks in per_rank for comm in COMM_TYPES):
            torch.testing.assert_close(output, expected.detach()[:, :, mine], msg=name)
            for got, want in ((dq, full[0].grad), (dk, full[1].grad), (dv, full[2].grad)):
                torch.testing.assert_close(got, want[:, :, mine], msg=name)
