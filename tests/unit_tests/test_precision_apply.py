"""The precision converter (precision/apply.py): layers are built with the plain GEMM, and
`apply_precision` alone swaps it for the one its config asks for; the copies it installs are the layers'
non-persistent buffers (they move with the model and stay out of checkpoints); the schedules' switch for
in-place gradient accumulation belongs to one model. Training with the swapped GEMMs:
test_weight_copies.py, test_float8_weight_copies.py, test_fp8.py."""

import pytest
import torch

from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.fp8.float8_mlp import swiglu_mlp
from megatron.core.fp8.float8_scaling import DelayedScalingConfig
from megatron.core.precision.apply import PrecisionConfig, apply_precision
from megatron.core.precision.working_copy import CopyGemm
from megatron.core.tensor_parallel.fp32_weight_grad import GemmLayer, LinearGemm, accumulating_into_grad
from megatron.core.transformer.mlp import MLP
from tests.unit_tests.test_weight_copies import build


def _gemms(model):
    return {name: type(module.gemm) for name, module in model.named_modules() if isinstance(module, GemmLayer)}


def test_a_built_model_multiplies_with_the_plain_gemm_until_the_converter_runs():
    model = build("llama", masked_only=True)
    assert set(_gemms(model).values()) == {LinearGemm}
    assert all(module.fused_forward is None for module in model.modules() if isinstance(module, MLP))
    assert apply_precision(model, PrecisionConfig(), torch.bfloat16) is None
    assert set(_gemms(model).values()) == {LinearGemm}


@pytest.mark.parametrize("fp8_format", [None, "hybrid"])
def test_the_converter_swaps_the_gemms_its_config_asks_for(fp8_format):
    model = build("llama", masked_only=True)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    delayed = DelayedScalingConfig() if fp8_format else None
    copies = apply_precision(model, PrecisionConfig(True, fp8_format, "delayed" if fp8_format else "tensorwise",
                                                    delayed), torch.bfloat16)
    gemms = _gemms(model)
    decoder = {name: kind for name, kind in gemms.items() if name.startswith("decoder.")}
    assert set(decoder.values()) == {Float8Gemm if fp8_format else CopyGemm} and len(decoder) == 2 * 4
    assert gemms["output_layer"] is CopyGemm  # the masked-only loss reads a compute-dtype copy, float8 or not
    assert gemms["embedding.word_embeddings"] is LinearGemm  # untied: its lookup reads no copy
    mlps = [module for module in model.modules() if isinstance(module, MLP)]
    assert all(module.fused_forward is (swiglu_mlp if fp8_format else None) for module in mlps)
    assert (copies.delayed_scaling is not None) == bool(fp8_format) and copies.float8_layers == (8 if fp8_format else 0)
    assert (copies.state_dict() is not None) == bool(fp8_format)
    assert model.state_dict().keys() == before.keys()  # the copies are not checkpointed
    fc1 = model.decoder.layers["0"].mlp.linear_fc1
    names = {name for name, _ in fc1.named_buffers()}  # the layer's buffers: they move with it
    assert names == ({"gemm.rows", "gemm.columns", "gemm.inverse_scale", "gemm.scales", "gemm.amax"} if fp8_format
                     else {"gemm.copy"})


def test_the_schedules_switch_is_one_models():
    model, other = build("llama"), build("llama")
    layers = [module for module in model.modules() if isinstance(module, GemmLayer)]
    with accumulating_into_grad(model):
        assert all(layer.grad_switch.in_place for layer in layers)
        assert len({id(layer.grad_switch) for layer in layers}) == 1  # one flip a micro-batch
        assert not any(module.grad_switch.in_place for module in other.modules() if isinstance(module, GemmLayer))
        with accumulating_into_grad(model, enabled=False):
            assert not layers[0].grad_switch.in_place
        assert layers[-1].grad_switch.in_place
    assert not any(layer.grad_switch.in_place for layer in layers)
