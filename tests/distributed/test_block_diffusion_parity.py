"""Block diffusion (--difflm-block-diffusion) and the two-sided sliding window under TP=2 with
sequence parallelism, DP=2, PP=2 and CP=2 equal one process: losses and step-1 gradients to 1e-5,
with Megatron's default configuration (biases on, LayerNorm) and the Llama style, per-block t
uniform and antithetic, cut lengths."""

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
}
CASES = [("megatron", "uniform", ()), ("megatron", "antithetic_bos_varilen", ()),
         ("llama", "antithetic_bos_varilen", ()), ("megatron", "two_sided_window", ())]
SUITE = LayoutCases({"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], CASES, False),
                     "dp2": (2, [], CASES, True),
                     "pp2": (2, ["--pipeline-model-parallel-size", "2"], CASES[:2], False),
                     "cp2": (2, ["--context-parallel-size", "2"], [CASES[0], CASES[2]], False)},
                    lambda config, mode, extra: BASE + CONFIGS[config] + MODES[mode])

references = SUITE.references_fixture()


def test_block_diffusion_in_every_layout_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
