"""Gradient-accumulation fusion across micro-batches on gloo: under --bf16, with several micro-batches
a step, the linear layers add their weight gradients into `.grad` in place (fp32_weight_grad) on every
micro-batch in one process and on every pipeline stage, and under DDP on its no-sync micro-batches only:
its last backward goes through autograd, whose hooks start the reduction. Data parallelism (replicated
and ZeRO-1) and two pipeline stages train the losses and step-1 gradients of one process, in Megatron's
default configuration and the Llama style, DLM and AR. (In one process the in-place sums equal autograd's to the bit:
tests/unit_tests/test_grad_accumulation_in_place.py.)"""

import pytest

from tests.distributed.parity import LayoutCases
from tests.distributed.test_layout_matrix import argv_of

pytestmark = pytest.mark.distributed

ACCUMULATING = ["--bf16", "--global-batch-size", "12"]  # 6 micro-batches in one process, 3 a replica
BOTH = [("megatron", "dlm", ()), ("megatron", "ar", ()), ("llama", "dlm", ()), ("llama", "ar", ())]
SUITE = LayoutCases({"dp2": (2, [], BOTH, True),
                     "dp2_zero1": (2, ["--use-distributed-optimizer"], [("llama", "dlm", ())], True),
                     # 1F1B: a stage's later forwards find the gradients of its earlier backwards
                     "pp2": (2, ["--pipeline-model-parallel-size", "2"],
                             [("megatron", "dlm", ()), ("llama", "ar", ())], False)},
                    lambda config, mode, extra: argv_of(config, mode) + ACCUMULATING)


def test_in_place_accumulation_trains_as_one_process(tmp_path):
    references = SUITE.references(tmp_path)
    results = SUITE.check(2, references, tmp_path)
    assert all(len(result["losses"]) == 3 for runs in results.values() for result in runs)
