"""Gradient-accumulation fusion across micro-batches (fp32_weight_grad.accumulating_into_grad): a linear
layer whose fp32 weight already holds a `.grad` adds the next micro-batch's gradient into it inside the
GEMM, and autograd gets none for it. The sums equal autograd's to the bit (CPU: the same bf16 product
added in fp32), in Megatron's default configuration and the Llama style, DLM and AR; an untied embedding
adds its looked-up rows into its `.grad` (tied_gradient.add_rows), within fp32 rounding of autograd's
dense sum (the rows are added one by one); a compiled layer calls the in-place op on the gradient itself;
the schedules enable it only where no wrapper's hook needs autograd's gradient."""

import pytest
import torch
from torch import nn

from megatron.core.distributed import data_parallel
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, fp32_weight_grad, tied_gradient
from megatron.core.transformer.compilation import compile_transformer_layers
from tests.unit_tests.test_gpt_model import dlm_config, tiny_config, tokens

STYLES = {"megatron": dict(add_bias_linear=True, normalization="LayerNorm", qk_layernorm=False),
          "llama": dict(add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True,
                        activation="silu", qk_layernorm=True, share_embeddings_and_output_weights=False)}
MODES = {"dlm": dict(model_running_mode="difflm-noshift"), "ar": dict(model_running_mode="vanilla")}
MICRO_BATCHES = 3
UNTIED_EMBEDDING = "embedding.word_embeddings.weight"  # the Llama style's (untied), the others' tied


def _model(style: str, mode: str, bf16: bool = True) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(tiny_config(bf16=bf16, **STYLES[style]), dlm_config(**MODES[mode]))


def _accumulate(model: GPTModel, in_place: bool) -> dict:
    with fp32_weight_grad.accumulating_into_grad(model, in_place):
        for index in range(MICRO_BATCHES):
            torch.manual_seed(100 + index)  # the same corruption for both runs
            model.compute_loss(tokens(seed=index), key=None).loss_sum.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("style", STYLES)
def test_micro_batches_add_into_the_gradient_in_place_to_the_bit(style, mode, bf16, monkeypatch):
    calls, original = [], fp32_weight_grad.accumulate_matmul_
    monkeypatch.setattr(fp32_weight_grad, "accumulate_matmul_", lambda *args: calls.append(1) or original(*args))
    reference = _accumulate(_model(style, mode, bf16), in_place=False)
    assert calls == []  # outside the context autograd sums them
    model = _model(style, mode, bf16)
    ours = _accumulate(model, in_place=True)
    linears = [module for module in model.decoder.modules() if isinstance(module, fp32_weight_grad.GemmLayer)]
    assert linears and len(calls) == len(linears) * (MICRO_BATCHES - 1)
    assert reference.keys() == ours.keys()
    for name in reference:
        if name == UNTIED_EMBEDDING and style == "llama":  # rows added one by one: test_an_untied_embedding_...
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max())
        else:
            assert torch.equal(ours[name], reference[name]), name


@pytest.mark.parametrize("mode", MODES)
def test_an_untied_embedding_adds_its_rows_into_the_gradient(mode, monkeypatch):
    """From the second micro-batch on the lookup's backward adds its rows into `.grad` (no dense [V, h]
    gradient for autograd to add); the sum is autograd's within fp32 rounding, and wrong rows fail it."""
    calls, original = [], tied_gradient.add_rows
    monkeypatch.setattr(tied_gradient, "add_rows", lambda grad, *args: calls.append(grad) or original(grad, *args))
    reference = _accumulate(_model("llama", mode), in_place=False)[UNTIED_EMBEDDING]
    assert calls == []
    model = _model("llama", mode)
    ours = _accumulate(model, in_place=True)[UNTIED_EMBEDDING]
    assert len(calls) == MICRO_BATCHES - 1 and all(grad is ours for grad in calls)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6 * reference.abs().max())
    assert reference.ne(0).any()


@pytest.mark.inductor  # reads the code inductor generates
def test_a_compiled_layer_adds_into_the_gradient_itself():
    """Under torch.compile the backward calls the in-place op on the gradient (no copy written back),
    and the gradients are those of the compiled layers without it."""
    from torch._inductor.utils import run_and_get_code

    compiled = []
    for in_place in (False, True):
        model = _model("llama", "dlm")
        compile_transformer_layers(model)
        compiled.append(run_and_get_code(_accumulate, model, in_place))
    (reference, reference_code), (ours, code) = compiled
    assert not any("megadlms.accumulate_matmul_" in source for source in reference_code)
    assert any("megadlms.accumulate_matmul_" in source for source in code)
    for name in reference:  # (the untied embedding's rows are added one by one: an absolute rounding too)
        atol = 1e-6 * reference[name].abs().max().item() if name == UNTIED_EMBEDDING else 0
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=atol, msg=name)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_a_gradient_it_cannot_add_into_goes_through_autograd():
    """A weight whose `.grad` is not a contiguous fp32 tensor of its shape gets autograd's sum."""
    weight = torch.randn(6, 4, requires_grad=True)
    weight.grad = torch.ones(4, 6).t()  # the right shape, not contiguous
    x = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_weight_grad.linear(x, weight, grad_into=fp32_weight_grad.grad_to_add_into(weight, True)).sum().backward()
    expected = torch.ones(6, 4) + (torch.ones(5, 6).bfloat16().t() @ x.bfloat16()).float()
    assert torch.equal(weight.grad, expected)


class _Sharded(nn.Module):
    """Stands for an FSDP2 module: data_parallel recognises one by set_requires_gradient_sync."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = ColumnParallelLinear(2, 2)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.sync = sync


def _layer_of(model: nn.Module) -> ColumnParallelLinear:
    return next(module for module in model.modules() if isinstance(module, ColumnParallelLinear))


def _in_place_under_no_sync(model: nn.Module, last: bool) -> bool:
    with data_parallel.no_sync(model, last_microbatch=last):
        return _layer_of(model).grad_switch.in_place


def _bare_ddp() -> nn.parallel.DistributedDataParallel:
    """A DistributedDataParallel object without a process group around one linear layer: enough for
    `no_sync`, which checks the type and enters DDP's own no_sync (it only flips require_backward_grad_sync)."""
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = ColumnParallelLinear(2, 2)
    ddp.require_backward_grad_sync = True
    return ddp


def test_the_schedules_enable_it_where_no_hook_needs_autograds_gradient():
    """data_parallel.no_sync switches the wrapped model's layers, and only them: another model's stay off."""
    plain, other = nn.Sequential(ColumnParallelLinear(2, 2)), ColumnParallelLinear(2, 2)
    assert _in_place_under_no_sync(plain, last=False) and _in_place_under_no_sync(plain, last=True)
    with data_parallel.no_sync(plain, last_microbatch=False):
        assert not other.grad_switch.in_place
    assert not _in_place_under_no_sync(_Sharded(), last=False) and not _in_place_under_no_sync(_Sharded(), True)
    ddp = _bare_ddp()
    assert _in_place_under_no_sync(ddp, last=False) and not _in_place_under_no_sync(ddp, last=True)
    with data_parallel.no_sync(ddp, last_microbatch=False):
        assert not ddp.require_backward_grad_sync  # DDP's own no_sync still entered
    assert ddp.require_backward_grad_sync and not _layer_of(ddp).grad_switch.in_place  # restored on leaving
    assert not _layer_of(plain).grad_switch.in_place


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_op_adds_the_fp32_product_in_place(device):
    """out += a @ b with bf16 operands and an fp32 out: on CUDA the GEMM's own fp32 result (beta = 1),
    elsewhere the bf16 product cast, as autograd's sum would add; into the same storage."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator).bfloat16().to(device) for shape in ((64, 48), (48, 40)))
    out = torch.randn(64, 40, generator=generator).to(device)
    before, pointer = out.clone(), out.data_ptr()
    fp32_weight_grad.accumulate_matmul_(out, a.t().contiguous().t(), b)
    product = torch.mm(a, b, out_dtype=torch.float32) if device == "cuda" else (a @ b).float()
    assert out.data_ptr() == pointer
    torch.testing.assert_close(out, before + product, rtol=1e-6, atol=1e-6)
