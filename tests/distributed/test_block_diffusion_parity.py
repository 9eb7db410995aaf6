"""Block diffusion (--difflm-block-diffusion) and the two-sided sliding window under TP=2 with
sequence parallelism and under DP=2 equal one process: losses and step-1 gradients to 1e-5, with
Megatron's default configuration (biases on, LayerNorm) and the Llama style, per-block t uniform
and antithetic, cut lengths."""

import pytest

from tests.distributed.parity import tp_sp_and_dp
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
}
CASES = [("megatron", "uniform", ()), ("megatron", "antithetic_bos_varilen", ()),
         ("llama", "antithetic_bos_varilen", ()), ("megatron", "two_sided_window", ())]
SUITE = tp_sp_and_dp(CASES, lambda config, mode, extra: BASE + CONFIGS[config] + MODES[mode])

references = SUITE.references_fixture()


def test_block_diffusion_under_tp_sp_and_dp_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
