"""A user's GPU defaults against the fp32 math reference: three training steps of every attention
mask, DLM and AR, dense and MoE, eager and under --torch-compile.

The fast arm is harness.FAST (bf16, `auto` attention, the fused loss, the SwiGLU kernel,
gradient-accumulation fusion; MoE adds --moe-grouped-gemm); the reference is fp32 with the math
attention and no fused kernel. Losses of every step, the step-1 grad norm and every step-1
gradient must agree within the bf16 bounds of harness.py: u = 2^-8, gradients 16 u relative per
tensor (a quadrature sum of ~40 roundings, times 4), losses u / 2, the grad norm 16 u; the
reference's loss must move by 5 loss bounds over the 3 steps. MoE arms replay the reference's
routing. Under MEGADLMS_GPU_SUITE_ON_CPU=1 both arms are fp32 and the bounds fp32's (about 2e-6).
"""

import pytest

from tests.gpu import harness
from tests.gpu.harness import FAST, MOE, REFERENCE, bound_of, compare, on_this_machine, train

pytestmark = harness.SUITE

VANILLA = ["--model-running-mode", "vanilla"]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
MASKS = {
    "dlm-no_mask": ["--attention-mask-type", "no_mask"],
    "dlm-causal": ["--attention-mask-type", "causal"],
    "dlm-block_causal": ["--attention-mask-type", "block_causal", "--difflm-block-size", "32"],
    "dlm-sliding_window": ["--attention-mask-type", "sliding_window", "--sliding-window", "48"],
    "dlm-sliding_window_two_sided": ["--attention-mask-type", "sliding_window_two_sided", "--sliding-window", "48"],
    "dlm-packed": PACKED + ["--difflm-per-document-t"],
    "dlm-block_diffusion": ["--difflm-block-diffusion", "--difflm-block-size", "32"],
    "ar-causal": VANILLA,
    "ar-sliding_window": VANILLA + ["--attention-mask-type", "sliding_window", "--sliding-window", "48"],
    "ar-packed": VANILLA + PACKED,
}
MOE_MASKS = ["dlm-no_mask", "ar-causal", "dlm-packed"]
# --torch-compile costs a compilation per case: one case of each attention kernel `auto` picks
# (SDPA: full and causal masks; FlexAttention: block and document masks), DLM and AR, dense and MoE.
COMPILED = [("dlm-block_causal", False), ("ar-causal", False), ("dlm-no_mask", True)]


@pytest.fixture(scope="module")
def references():
    """The fp32 reference of each configuration, trained once for the module's tests."""
    cache = {}

    def reference(flags: tuple) -> harness.Run:
        if flags not in cache:
            cache[flags] = train(list(flags))
        return cache[flags]

    return reference


def check(case: str, moe: bool, compiled: bool, references) -> harness.Run:
    model = MASKS[case] + (MOE if moe else [])
    reference = references(tuple(model + REFERENCE))
    fast_flags = on_this_machine(model + FAST + (["--moe-grouped-gemm"] if moe else [])
                                 + (["--torch-compile"] if compiled else []))
    fast = train(fast_flags, replay=reference if moe else None)
    bound = bound_of(fast_flags)
    compare(fast, reference, bound, f"{case}{' moe' if moe else ''}{' compiled' if compiled else ''}")
    harness.assert_loss_moves(reference, bound)
    assert fast.compiled_layers == (2 if compiled else 0)
    return fast


@pytest.mark.parametrize("case", list(MASKS))
def test_dense_matches_the_fp32_reference(case, references):
    check(case, moe=False, compiled=False, references=references)


@pytest.mark.parametrize("case", MOE_MASKS)
def test_moe_matches_the_fp32_reference(case, references):
    fast = check(case, moe=True, compiled=False, references=references)
    assert len(fast.routing) == 2 * 2 * harness.STEPS, "2 MoE layers x 2 micro-batches x 3 steps routed"


@pytest.mark.parametrize("case, moe", COMPILED, ids=[f"{case}{'-moe' if moe else ''}" for case, moe in COMPILED])
def test_compiled_matches_the_fp32_reference(case, moe, references):
    check(case, moe=moe, compiled=True, references=references)
