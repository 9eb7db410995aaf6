"""The float8 layers across micro-batches inside fp32_weight_grad.accumulating_into_grad(model): every float8
layer (the fused SwiGLU MLP's two included) adds its weight gradient into `.grad` through its GEMM
(cublaslt.scaled_mm_add_) from the second micro-batch on, and the sums are autograd's to the bit (CPU:
the op adds `_scaled_mm`'s fp32 product, as autograd did), in Megatron's default configuration and the
Llama style, DLM and AR. Fails if the in-place mode drops or doubles a float8 layer's gradient, or leaves
it to autograd."""

import pytest
import torch

from megatron.core.tensor_parallel import fp32_weight_grad
from megatron.core.fp8 import float8_matmul
from megatron.core.precision.weight_copies import WeightCopies
from tests.unit_tests.test_gpt_model import tokens
from tests.unit_tests.test_weight_copies import STYLES, build

MODES = ("difflm-noshift", "vanilla")
MICRO_BATCHES = 3


def _accumulate(style: str, mode: str, in_place: bool) -> dict:
    model = build(style, mode)
    copies = WeightCopies(model, torch.bfloat16, "hybrid")
    assert copies.float8_layers == 2 * 4  # two layers of four linears
    copies.refresh()
    with fp32_weight_grad.accumulating_into_grad(model, in_place), torch.autocast("cpu", dtype=torch.bfloat16):
        for index in range(MICRO_BATCHES):
            torch.manual_seed(100 + index)  # the same corruption for both runs
            model.compute_loss(tokens(seed=index), key=None).loss_sum.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("style", STYLES)
def test_float8_layers_add_their_weight_gradients_in_place_as_autograd_does(style, mode, monkeypatch):
    calls, original = [], float8_matmul.scaled_mm_add_
    monkeypatch.setattr(float8_matmul, "scaled_mm_add_", lambda out, *args: calls.append(out) or original(out, *args))
    reference = _accumulate(style, mode, in_place=False)
    assert calls == []  # outside the context autograd sums them
    ours = _accumulate(style, mode, in_place=True)
    assert len(calls) == 2 * 4 * (MICRO_BATCHES - 1)  # every float8 layer from the second micro-batch on
    assert len({id(grad) for grad in calls}) == 2 * 4  # each into its own weight's gradient
    assert reference.keys() == ours.keys()
    for name in reference:  # the untied embedding adds its rows one by one (test_grad_accumulation_in_place.py)
        if name == "embedding.word_embeddings.weight":
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max())
        else:
            assert torch.equal(ours[name], reference[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with float8 GEMMs (compute capability 8.9+)")
@pytest.mark.parametrize("bias", [False, True], ids=["llama-no-bias", "megatron-bias"])
def test_on_a_float8_gpu_a_compiled_layer_adds_through_cublaslts_gemm(bias, monkeypatch):
    """A compiled transformer layer of float8 layers over three micro-batches: inside the context every
    float8 layer's GEMM adds into `.grad` from the second micro-batch on (cuBLASLt's beta = 1, not the
    fallback), and the sums are those of the same compiled layer outside it within fp32 rounding."""
    from megatron.core.fusions import cublaslt
    from megatron.core.transformer.attention_mask import AttentionMask
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls, original = [], cublaslt._Lt.scaled_mm_add_  # the gradients added into (and the first-call checks' copies)
    monkeypatch.setattr(cublaslt._Lt, "scaled_mm_add_",
                        lambda self, out, *args: calls.append(out.data_ptr()) or original(self, out, *args))
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                               gated_linear_unit=not bias, activation="gelu" if bias else "silu", add_bias_linear=bias)
    layers = [TransformerLayer(config, 0).cuda() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    grads = []
    for layer, in_place in zip(layers, (False, True)):
        WeightCopies(layer, torch.bfloat16, "hybrid").refresh()
        compiled = torch.compile(layer)
        with fp32_weight_grad.accumulating_into_grad(layer, in_place):
            for index in range(MICRO_BATCHES):
                x = torch.randn(256, 4, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(index))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = compiled(x.requires_grad_(), AttentionMask("no_mask"))
                out.float().square().mean().backward()
        grads.append([p.grad for p in layer.parameters()])
        into_grads = [pointer for pointer in calls if pointer in {grad.data_ptr() for grad in grads[-1]}]
        assert len(into_grads) == (0 if not in_place else 4 * (MICRO_BATCHES - 1))
    for ours, reference in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
