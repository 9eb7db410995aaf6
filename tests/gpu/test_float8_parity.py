"""--fp8-format against bf16: three training steps of a user's GPU defaults with the decoder's linear
layers in float8 (the flag alone, as a user gives it, which trains from float8 weight copies with the
tensorwise recipe; the delayed recipe, eager and under --torch-compile), against the same run in bf16.

Bounds (harness.py): u of the format's narrowest type (e4m3 2^-4; hybrid's e5m2 gradients 2^-3);
gradients 4 u relative per tensor (float8 rounds only the GEMM operands of the linear layers, about
12 on a gradient's path: sqrt(12 / 3) = 2, times 2), losses u / 2, the step-1 grad norm 4 u. The
delayed recipe's first step scales by the tensors' own amaxes; steps 2 and 3, scaled by the
recorded ones, are checked through their losses. All 8 linear layers (2 layers x qkv, proj, fc1,
fc2) must train in float8, or the test would compare bf16 with itself.

Float8 runs on a CPU too (eagerly, through torch's `_scaled_mm`), so under
MEGADLMS_GPU_SUITE_ON_CPU=1 these tests run float8 against bf16 there with the same bounds; the
compiled case is refused on a CPU (precision_args.validate_precision_args) and skipped.
"""

import pytest

from tests.gpu import harness
from tests.gpu.harness import FAST, bound_of, compare, train

pytestmark = harness.SUITE

CASES = {
    "e4m3-tensorwise": ["--fp8-format", "e4m3"],
    "hybrid-delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "hybrid-delayed-compiled": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--torch-compile"],
}
NEEDS = {
    "hybrid-delayed-compiled": pytest.mark.skipif(harness.ON_CPU, reason="float8 under --torch-compile "
                                                         "is refused on a CPU (Inductor's CPU code)"),
}


@pytest.fixture(scope="module")
def bf16_runs():
    """The bf16 arm, eager and compiled, trained once for the module."""
    cache = {}

    def run(compiled: bool) -> harness.Run:
        if compiled not in cache:
            cache[compiled] = train(FAST + (["--torch-compile"] if compiled else []))
        return cache[compiled]

    return run


@pytest.mark.parametrize("case", [pytest.param(case, marks=NEEDS.get(case, ())) for case in CASES])
def test_float8_matches_bf16(case, bf16_runs):
    flags = FAST + CASES[case]
    float8 = train(flags)
    assert float8.float8_layers == 8, "every linear layer of the decoder trains in float8"
    compare(float8, bf16_runs("--torch-compile" in flags), bound_of(flags), case)
