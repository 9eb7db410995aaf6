"""The float8 layers across micro-batches inside fp32_weight_grad.accumulating_into_grad, where the bf16
layers add their weight gradients into `.grad` through their GEMM: the float8 layers' gradients (which
autograd adds, `_scaled_mm` having no beta) are the same sums as outside it, in Megatron's default
configuration and the Llama style, DLM and AR. Fails if the in-place mode drops or doubles a float8
layer's gradient."""

import pytest
import torch

from megatron.core.tensor_parallel import fp32_weight_grad
from megatron.core.tensor_parallel.weight_copies import WeightCopies
from tests.unit_tests.test_gpt_model import tokens
from tests.unit_tests.test_weight_copies import STYLES, build

MODES = ("difflm-noshift", "vanilla")
MICRO_BATCHES = 3


def _accumulate(style: str, mode: str, in_place: bool) -> dict:
    model = build(style, mode)
    copies = WeightCopies(model, torch.bfloat16, "hybrid")
    assert copies.float8_layers == 2 * 4  # two layers of four linears
    copies.refresh()
    with fp32_weight_grad.accumulating_into_grad(in_place), torch.autocast("cpu", dtype=torch.bfloat16):
        for index in range(MICRO_BATCHES):
            torch.manual_seed(100 + index)  # the same corruption for both runs
            model.compute_loss(tokens(seed=index), key=None).loss_sum.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("style", STYLES)
def test_float8_layers_sum_their_weight_gradients_as_autograd_does(style, mode):
    reference = _accumulate(style, mode, in_place=False)
    ours = _accumulate(style, mode, in_place=True)
    assert reference.keys() == ours.keys()
    for name in reference:  # the untied embedding adds its rows one by one (test_grad_accumulation_in_place.py)
        if name == "embedding.word_embeddings.weight":
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max())
        else:
            assert torch.equal(ours[name], reference[name]), name
