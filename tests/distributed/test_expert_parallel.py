"""Mixture-of-experts layers under expert parallelism equal one process.

A tiny MoE (8 experts, top-2, dropless, load-balancing and z-loss on) in Megatron's default
configuration (biases, LayerNorm, GeLU experts) and the Llama style (SwiGLU experts, shared
expert), DLM and AR, expert-choice routing and aux-loss-free expert bias: EP=2 and EP=4 over the
data-parallel ranks, EP=2 x TP=2 with sequence parallelism, EP=2 x DP=2 (expert-dp replicas),
expert TP=2 (alone and with EP=2 x TP=2), with PP=2 and CP=2, under ZeRO-1 and FSDP2 (experts
sharded over their own replicas); both token dispatchers. Every
loss and every step-1 gradient (the balancing losses' included: they shape the router's and every
earlier layer's gradients) must match the single-process run to 1e-5 (gloo, fp32).
"""

import pytest

from tests.distributed.parity import LayoutCases
from tests.distributed.test_layout_matrix import CONFIGS, GQA, MODES, SHAPE

pytestmark = pytest.mark.distributed

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "4"]
SHARED = ("--moe-shared-expert-intermediate-size", "32")
EXPERT_CHOICE = ("--moe-router-type", "expert_choice", "--moe-aux-loss-coeff", "0")
BIAS = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss")
CASES = [("megatron", "dlm", ()), ("megatron", "ar", ()), ("llama", "dlm", SHARED), ("llama", "ar", SHARED),
         ("megatron", "dlm", EXPERT_CHOICE), ("llama", "ar", BIAS)]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
ETP2 = ["--expert-tensor-parallel-size", "2"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ZERO1 = ["--use-distributed-optimizer"]
ZERO2, FSDP2 = (["--data-parallel-sharding-strategy", strategy] for strategy in ("optim_grads", "optim_grads_params"))
# layout: (world size, parallel flags, the cases it trains, gradients compared by name)
LAYOUTS = {
    "ep2": (2, EP2, CASES, False),
    "ep2_alltoall": (2, EP2 + A2A, [CASES[0], CASES[3], CASES[4]], False),
    "etp2": (2, ETP2 + A2A, [CASES[0], CASES[3]], False),
    "ep4": (4, EP4, [CASES[5]], False),
    "ep4_alltoall": (4, EP4 + A2A, [CASES[1], CASES[2]], False),
    "ep2_tp2_sp": (4, EP2 + TP2_SP + A2A, [CASES[0], CASES[1], CASES[4]], False),
    "ep2_dp2": (4, EP2 + A2A, [CASES[3]], False),
    "ep2_etp2_tp2_sp": (4, EP2 + ETP2 + TP2_SP + A2A, [CASES[1], CASES[2]], False),
    "ep2_pp2": (4, EP2 + ["--pipeline-model-parallel-size", "2"], [CASES[0], CASES[3]], False),
    "ep2_cp2": (4, EP2 + A2A + ["--context-parallel-size", "2"], [CASES[1], CASES[4]], False),
    # Optimizer state and weights sharded: the experts over their expert-dp replicas (none with
    # EP=2 on 2 ranks: plain AdamW / left to themselves by FSDP2; two with EP=2 on 4 ranks).
    "ep2_zero1": (2, EP2 + ZERO1, [CASES[4]], False),
    "ep2_fsdp2": (2, EP2 + FSDP2, [CASES[1], CASES[2]], False),
    "ep2_dp2_zero1": (4, EP2 + A2A + ZERO1, [CASES[0]], False),
    "ep2_dp2_zero2": (4, EP2 + ZERO2, [CASES[3]], False),
}


def argv_of(config: str, mode: str, extra: tuple) -> list:
    """"megatron" is Megatron's default configuration (biases, LayerNorm, GeLU, tied) with 2 kv heads."""
    return SHAPE + BATCH + (GQA if config == "megatron" else CONFIGS[config]) + MODES[mode] + MOE + list(extra)


SUITE = LayoutCases(LAYOUTS, argv_of)


references = SUITE.references_fixture()


@pytest.mark.parametrize("world_size", SUITE.world_sizes())
def test_expert_parallel_layouts_match_one_process(world_size, references, tmp_path):
    """Every layout of LAYOUTS with `world_size` processes, each case against its single-process run."""
    assert SUITE.check(world_size, references, tmp_path)
