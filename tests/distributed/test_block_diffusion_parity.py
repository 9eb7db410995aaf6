"""Block diffusion (--difflm-block-diffusion) and the two-sided sliding window under TP=2 with
sequence parallelism, DP=2, PP=2 and CP=2 equal one process: losses and step-1 gradients to 1e-5,
with Megatron's default configuration (biases on, LayerNorm) and the Llama style, per-block t
uniform and antithetic, cut lengths; a bell-shaped (beta) t per block and a logit-normal t per row, each
importance-weighted, a block-size curriculum, the joint AR + DLM objective and the confidence-aware loss (each
term of the loss compared) under TP=2+SP, PP=2 and CP=2."""

import pytest

from tests.distributed.parity import LayoutCases
from tests.distributed.test_sft_parity import CONFIGS, SHAPE

pytestmark = pytest.mark.distributed

BASE = [flag for flag in SHAPE if flag != "--sft"]
BD3 = ["--difflm-block-diffusion", "--difflm-block-size", "8"]
MODES = {
    "uniform": BD3,
    "antithetic_bos_varilen": BD3 + ["--difflm-t-sampling", "antithetic", "--difflm-ignore-bos",
                                     "--difflm-varilen-prob", "0.5"],
    "two_sided_window": ["--attention-mask-type", "sliding_window_two_sided", "--sliding-window", "5",
                         "--reset-attention-mask", "--reset-position-ids"],
    # Non-uniform t (t_distribution.py): a bell per block, importance-weighted; logit-normal per row.
    "beta_t_blocks": BD3 + ["--difflm-t-distribution", "beta", "--difflm-t-beta", "3", "2",
                            "--difflm-t-sampling", "antithetic"],
    "logit_normal_t": ["--difflm-t-distribution", "logit_normal", "--difflm-t-logit-normal-mean", "0.5"],
    # A block-size curriculum on packed documents: each of the 3 steps with another block size (4, 8, then 32:
    # one block).
    "block_curriculum": ["--difflm-block-diffusion", "--difflm-block-size-schedule", "0:4,1:8,2:32",
                         "--difflm-t-sampling", "antithetic", "--reset-attention-mask", "--reset-position-ids"],
    # The joint AR + DLM objective on packed documents, with EOD's next-token loss masked.
    "joint_ar": BD3 + ["--difflm-ar-loss-weight", "0.5", "--reset-attention-mask", "--reset-position-ids",
                       "--eod-mask-loss"],
    # The joint objective under LLaDA's per-sequence normalization (each row's mean, then the mean over rows).
    "joint_ar_sequence": BD3 + ["--difflm-ar-loss-weight", "0.5", "--difflm-loss-normalizer", "sequence"],
    # The confidence-aware loss (the vocabulary-parallel entropy under TP), with the shift mode's alignment and
    # on the joint objective's noisy half (in the Llama style some masked tokens are right by step 3).
    "cap_shift": ["--model-running-mode", "difflm-shift", "--difflm-confidence-loss-weight", "0.5"],
    "joint_ar_cap": BD3 + ["--difflm-ar-loss-weight", "0.5", "--difflm-confidence-loss-weight", "0.5"],
}
CASES = [("megatron", "uniform", ()), ("megatron", "antithetic_bos_varilen", ()),
         ("llama", "antithetic_bos_varilen", ()), ("megatron", "two_sided_window", ())]
T_CASES = [("llama", "beta_t_blocks", ()), ("megatron", "logit_normal_t", ()), ("megatron", "block_curriculum", ()),
           ("llama", "block_curriculum", ()), ("megatron", "joint_ar", ()), ("llama", "joint_ar", ()),
           ("llama", "cap_shift", ()), ("llama", "joint_ar_cap", ()), ("megatron", "joint_ar_sequence", ())]
SUITE = LayoutCases({"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], CASES + T_CASES,
                                False),
                     "dp2": (2, [], CASES, True),
                     "pp2": (2, ["--pipeline-model-parallel-size", "2"], CASES[:2] + T_CASES, False),
                     "cp2": (2, ["--context-parallel-size", "2"], [CASES[0], CASES[2]] + T_CASES, False)},
                    lambda config, mode, extra: BASE + CONFIGS[config] + MODES[mode])

references = SUITE.references_fixture()


def test_block_diffusion_in_every_layout_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
