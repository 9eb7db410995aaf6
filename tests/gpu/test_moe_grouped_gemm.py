"""--moe-grouped-gemm (one grouped GEMM per projection over all experts) against the per-expert loop
(one GEMM per expert), both in bf16 with a user's other GPU defaults, under identical routing: the
grouped run replays the loop run's expert choices (harness.RoutingReplay), so the runs differ only
in how each expert's GEMMs are scheduled and accumulated.

Bounds: harness.py's bf16 ones (u = 2^-8; gradients 16 u relative per tensor, losses u / 2). The
two arms round the same bf16 operands and accumulate in fp32 in different orders, so an expert
output may differ by one bf16 rounding (u); downstream every later bf16 rounding can flip with it,
which makes the difference of the same kind, and at most the size, as bf16 against fp32. The
grouped kernel must have run (its calls are counted), or the test would compare the loop with itself.
Grouped GEMM is CUDA's only: under MEGADLMS_GPU_SUITE_ON_CPU=1 this module is skipped.
"""

import pytest
import torch

from tests.gpu import harness
from tests.gpu.harness import BF16_UNIT_ROUNDOFF, FAST, MOE, Bound, compare, train

pytestmark = harness.SUITE + [pytest.mark.skipif(harness.ON_CPU, reason="grouped GEMM runs on CUDA only: on a CPU "
                                                 "both arms would be the same per-expert loop")]


def counted_grouped_mm(monkeypatch) -> list:
    """Count the grouped GEMM calls (experts.grouped_linear looks the function up at each call)."""
    calls = []
    name = "grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else None
    owner = torch.nn.functional if name else torch
    name = name or "_grouped_mm"
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("mode", [[], ["--model-running-mode", "vanilla"]], ids=["dlm", "ar"])
def test_grouped_gemm_matches_the_per_expert_loop(mode, monkeypatch):
    loop = train(mode + MOE + FAST)
    calls = counted_grouped_mm(monkeypatch)
    grouped = train(mode + MOE + FAST + ["--moe-grouped-gemm"], replay=loop)
    # forward: fc1 and fc2 of 2 layers, 2 micro-batches, 3 steps; backward adds the input gradients
    assert len(calls) >= 2 * 2 * 2 * harness.STEPS, len(calls)
    compare(grouped, loop, Bound(BF16_UNIT_ROUNDOFF), "grouped GEMM against the per-expert loop")
