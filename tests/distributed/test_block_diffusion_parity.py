"""Block diffusion (--difflm-block-diffusion) under TP=2 with sequence parallelism and under DP=2
equals one process: losses and step-1 gradients to 1e-5, with Megatron's default configuration
(biases on, LayerNorm) and the Llama style, per-block t uniform and antithetic, cut lengths."""

import pytest

from tests.distributed.parity import tp_sp_and_dp
from tests.distributed.test_sft_parity import CONFIGS, SHAPE

pytestmark = pytest.mark.distributed

BD3 = [flag for flag in SHAPE if flag != "--sft"] + ["--difflm-block-diffusion", "--difflm-block-size", "8"]
MODES = {
    "uniform": [],
    "antithetic_bos_varilen": ["--difflm-t-sampling", "antithetic", "--difflm-ignore-bos",
                               "--difflm-varilen-prob", "0.5"],
}
CASES = [("megatron", "uniform", ()), ("megatron", "antithetic_bos_varilen", ()),
         ("llama", "antithetic_bos_varilen", ())]
SUITE = tp_sp_and_dp(CASES, lambda config, mode, extra: BD3 + CONFIGS[config] + MODES[mode])

references = SUITE.references_fixture()


def test_block_diffusion_under_tp_sp_and_dp_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
