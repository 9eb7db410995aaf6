"""One RL policy-gradient update (megatron/rl/step.py, fixed rollouts: tests/distributed/rl_entry.py) under
TP=2 with sequence parallelism, DP=2 and PP=2 equals one process: the policy loss of every step and every
step-1 gradient to 1e-5, with Megatron's defaults and the Llama style, for the d1 estimator of a DLM, the
exact AR-order one of a block-diffusion DLM, the exact one of an AR policy and SPG's bounds (a difflm-shift
DLM: two masked copies a row, the visible tokens masked at the default 0.15), each in both styles."""

import pytest

from tests.distributed.parity import LayoutCases
from tests.distributed.test_sft_parity import CONFIGS, SHAPE

pytestmark = pytest.mark.distributed

BASE = [flag for flag in SHAPE if flag != "--sft"]
MODES = {
    "diffu_grpo": ["--model-running-mode", "difflm-noshift"],
    "ar_order": ["--model-running-mode", "difflm-noshift", "--difflm-block-diffusion", "--difflm-block-size", "8"],
    "ar": ["--model-running-mode", "vanilla"],
    "spg": ["--model-running-mode", "difflm-shift"],
}
CASES = [(config, mode, ()) for mode in MODES for config in ("megatron", "llama")]
SUITE = LayoutCases({"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], CASES, False),
                     "dp2": (2, [], CASES, True),
                     "pp2": (2, ["--pipeline-model-parallel-size", "2"], CASES, False)},
                    lambda config, mode, extra: BASE + CONFIGS[config] + MODES[mode],
                    entry="tests.distributed.rl_entry")

references = SUITE.references_fixture()


def test_an_rl_update_in_every_layout_matches_one_process(references, tmp_path):
    assert SUITE.check(2, references, tmp_path)
