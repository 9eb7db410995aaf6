"""The MoE experts' grouped GEMM (--moe-grouped-gemm: one torch grouped_mm over all local experts) against
the per-expert loop: the loop against one GEMM per expert written out; the kernel path through torch's CPU
grouped_mm; the experts module on CPU (where the flag runs the loop) against each expert's MLP written out;
and on CUDA in bf16, forward and backward, the module with the flag against the module without it.

Tolerances come from rounding. U is the unit roundoff of a GEMM's output format (2^-8 for bf16, 2^-24
for fp32): rounding moves a value by at most U of itself. A GEMM entry sums at most k products; each path
forms and adds them in fp32 in its own order, off by at most k * 2^-24 * M (M: the sum of the products'
absolute values; a product of bf16 numbers is exact in fp32), then rounds the sum to the output format
once (at most U * M), and cuBLAS may round a split-K partial sum to bf16 once more (torch allows it by
default). Two paths that give a GEMM the same operands so agree within 2 * (k * 2^-24 + 2 * U) * M,
entry by entry (`assert_within`)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.config import MoEConfig
from megatron.core.transformer.moe.experts import GroupedExperts, grouped_linear, grouped_mm_linear, looped_linear
from megatron.core.transformer.transformer_config import TransformerConfig

BF16_U = 2.0 ** -8


def per_expert_t(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`[E, m, n]`: a_e^T b_e over each expert's rows (a weight gradient's shape)."""
    rows = counts.tolist()
    return torch.stack([p.t() @ q for p, q in zip(a.split(rows), b.split(rows))])


def magnitudes(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor):
    """M, in fp64, of the three GEMMs of y = x W_e^T with y's gradient `grad`: y, x's gradient grad_e W_e
    and W_e's gradient grad_e^T x_e."""
    x, weight, grad = (t.detach().double().abs() for t in (x, weight, grad))
    return (looped_linear(x, weight, counts), looped_linear(grad, weight.transpose(1, 2), counts),
            per_expert_t(grad, x, counts))


def assert_within(actual, expected, magnitude, unit: float, k: int, name: str) -> None:
    """|actual - expected| <= 2 * (k * 2^-24 + 2 * unit) * magnitude entry by entry (the module docstring)."""
    bound = 2 * (k * 2.0 ** -24 + 2 * unit) * magnitude
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{name}: the paths differ by up to {excess.max().item():.3g} beyond the bound"


def expert_config(grouped: bool, gated: bool = True, bias: bool = False, hidden: int = 32,
                  ffn: int = 16) -> TransformerConfig:
    """Four experts; SwiGLU (the default) when gated, else ReLU."""
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                             vocab_size=64, gated_linear_unit=gated, activation="silu" if gated else "relu",
                             add_bias_linear=bias, moe=MoEConfig(num_experts=4, router_topk=2, grouped_gemm=grouped))


def grouped_mm_calls(monkeypatch) -> list:
    """Records each call of torch's grouped_mm (the kernel path's forward) and lets it run."""
    calls, kernel = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *args, **kwargs: calls.append(args) or kernel(*args, **kwargs))
    return calls


def test_the_per_expert_loop_equals_one_gemm_per_expert():
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 8, requires_grad=True)
    weight = torch.randn(4, 6, 8, requires_grad=True)
    looped = grouped_linear(x, weight, torch.tensor(counts), grouped=False)
    expected = torch.cat([x[sum(counts[:e]):sum(counts[:e + 1])] @ weight[e].t() for e in range(4)])
    torch.testing.assert_close(looped, expected)
    grads = torch.autograd.grad(looped.square().sum(), (x, weight))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (x, weight)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_mm_path_equals_the_loop_on_cpu(dtype):
    """The kernel path (offsets from the counts, the weights transposed) through torch's CPU grouped_mm,
    forward and backward, against the loop on the same operands, an expert without tokens among them.
    Widths are multiples of 16 bytes, as grouped_mm needs. k = 48: the widest sum (x's gradient)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([9, 0, 20, 11])
    x, weight, grad = (torch.randn(shape, generator=generator).to(dtype) for shape in ((40, 32), (4, 48, 32), (40, 48)))
    results = []
    for path in (grouped_mm_linear, looped_linear):
        leaves = [t.clone().requires_grad_() for t in (x, weight)]
        y = path(*leaves, counts)
        results.append((y, *torch.autograd.grad(y, leaves, grad)))
    unit = torch.finfo(dtype).eps / 2
    for name, ours, loop, magnitude in zip(("y", "x's gradient", "weight's gradient"), *results,
                                           magnitudes(x, weight, grad, counts)):
        assert_within(ours, loop, magnitude, unit, k=48, name=name)


def expert_mlp(experts: GroupedExperts, expert: int, x: torch.Tensor, gated: bool) -> torch.Tensor:
    """One expert's MLP on its rows, as a dense MLP computes it (fc1's rows: gate, then up)."""
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    hidden = x @ fc1.weight[expert].t() + (fc1.bias[expert] if fc1.bias is not None else 0)
    gate, up = hidden.chunk(2, dim=-1) if gated else (hidden, None)
    activated = F.silu(gate) * up if gated else F.relu(gate)
    return activated @ fc2.weight[expert].t() + (fc2.bias[expert] if fc2.bias is not None else 0)


@pytest.mark.parametrize("gated, bias", [(True, False), (False, True)], ids=["swiglu", "relu-bias"])
def test_on_cpu_the_experts_with_the_flag_are_their_mlps_written_out(gated, bias, monkeypatch):
    """--moe-grouped-gemm on CPU runs one GEMM per expert (grouped_mm is the CUDA bf16 path): forward and
    backward equal each expert's MLP written out, in fp32 and the same operations (torch's fp32 tolerance)."""
    calls = grouped_mm_calls(monkeypatch)
    torch.manual_seed(0)
    experts = GroupedExperts(expert_config(grouped=True, gated=gated, bias=bias))
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(std=0.5)  # non-zero biases
    counts = torch.tensor([9, 0, 20, 11])
    tokens = torch.randn(40, 32, requires_grad=True)
    out = experts(tokens, counts)
    expected = torch.cat([expert_mlp(experts, e, rows, gated) for e, rows in enumerate(tokens.split(counts.tolist()))])
    torch.testing.assert_close(out, expected)
    leaves, probe = [tokens, *experts.parameters()], torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, leaves, probe), torch.autograd.grad(expected, leaves, probe))
    assert calls == []


def cuda_pair(gated: bool, bias: bool, hidden: int, ffn: int, values: torch.Tensor):
    """The experts with and without --moe-grouped-gemm on CUDA, fp32 weights as the trainer keeps them, both
    holding the same integer weights drawn from `values`."""
    generator = torch.Generator().manual_seed(0)
    pair = [GroupedExperts(expert_config(grouped, gated, bias, hidden, ffn)).cuda() for grouped in (True, False)]
    with torch.no_grad():
        for params in zip(*(experts.parameters() for experts in pair)):
            drawn = values[torch.randint(len(values), params[0].shape, generator=generator)]
            for param in params:
                param.copy_(drawn)
    return pair


def forward_backward(experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor, probe: torch.Tensor):
    """The output under bf16 autocast, then the gradients (d(output * probe)) of the tokens and of each
    parameter."""
    leaf = tokens.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = experts(leaf, counts)
    assert out.dtype == torch.bfloat16
    return [out, *torch.autograd.grad(out, [leaf, *experts.parameters()], probe)]


def integers(shape, values, generator, dtype=torch.float32) -> torch.Tensor:
    return values[torch.randint(len(values), shape, generator=generator)].to(dtype).cuda()


@pytest.mark.gpu
def test_on_cuda_the_grouped_experts_equal_the_loop_to_the_bit_on_small_integers(monkeypatch):
    """ReLU experts with biases; tokens, weights and the probe in {-1, 0, 1}, hidden 16, ffn 8, at most 15
    tokens an expert: fc1 <= 16 + 1, fc2 <= 8 * 17 + 1, the gradients <= 15 * 17, all integers below 256,
    which bf16 holds exactly and fp32 adds exactly in any order. No rounding happens on either path, so
    the grouped GEMMs give the loop's numbers to the bit: wrong offsets, a transposed weight or a gradient
    sent to another expert cannot hide in a tolerance."""
    calls = grouped_mm_calls(monkeypatch)
    values, generator = torch.tensor([-1.0, 0.0, 1.0]), torch.Generator().manual_seed(1)
    grouped, loop = cuda_pair(gated=False, bias=True, hidden=16, ffn=8, values=values)
    counts = torch.tensor([5, 0, 15, 7], device="cuda")
    tokens, probe = integers((27, 16), values, generator), integers((27, 16), values, generator, torch.bfloat16)
    ours = forward_backward(grouped, tokens, counts, probe)
    assert len(calls) == 2  # fc1 and fc2 through grouped_mm
    theirs = forward_backward(loop, tokens, counts, probe)
    assert len(calls) == 2
    names = ["output", "tokens"] + [name for name, _ in grouped.named_parameters()]
    for name, mine, reference in zip(names, ours, theirs):
        assert torch.equal(mine, reference), name
    assert all(grad.abs().sum() > 0 for grad in ours[1:])  # every gradient reached: no vacuous equality


def swiglu_magnitudes(experts: GroupedExperts, tokens, counts, probe):
    """M (fp64) of the GEMMs whose sums are not exact in the SwiGLU case: the output, then the gradients of
    the tokens, fc1's weight and fc2's weight; from the fp64 intermediates of the same integer operands."""
    x, w1, w2, grad = (t.detach().double() for t in (tokens, experts.linear_fc1.weight, experts.linear_fc2.weight,
                                                      probe))
    hidden = looped_linear(x, w1, counts).requires_grad_()
    gate, up = hidden.chunk(2, dim=-1)
    activated = F.silu(gate) * up
    hidden_grad, = torch.autograd.grad(activated, hidden, looped_linear(grad, w2.transpose(1, 2), counts))
    output, _, fc2 = magnitudes(activated, w2, grad, counts)
    _, tokens_grad, fc1 = magnitudes(x, w1, hidden_grad, counts)
    return output, tokens_grad, fc1, fc2


@pytest.mark.gpu
def test_on_cuda_the_grouped_swiglu_experts_match_the_loop_within_bf16_rounding(monkeypatch):
    """The default experts (SwiGLU, through its Triton kernel where it runs; no bias), fp32 weights under bf16
    autocast as the trainer runs them. Integer tokens and fc1 weights in [-2, 2] keep fc1's sums
    (<= 32 * 4) exact, and a probe in {-1, 0, 1} the gradient into the activation (<= 32 * 2), so both paths
    give the activation and its backward the same operands. The output and the gradients of the tokens,
    fc1 and fc2 are then each one GEMM of equal operands whose sums round: within the module docstring's
    bound of the loop's, k = 32 (fc1's width, the widest sum), M from the fp64 intermediates (the bf16 ones
    are within a few U of them: the factor 1 + 4U)."""
    calls = grouped_mm_calls(monkeypatch)
    values, generator = torch.arange(-2.0, 3.0), torch.Generator().manual_seed(2)
    grouped, loop = cuda_pair(gated=True, bias=False, hidden=32, ffn=16, values=values)
    counts = torch.tensor([9, 0, 20, 11], device="cuda")
    tokens = integers((40, 32), values, generator)
    probe = integers((40, 32), torch.tensor([-1.0, 0.0, 1.0]), generator, torch.bfloat16)
    ours = forward_backward(grouped, tokens, counts, probe)
    assert len(calls) == 2
    theirs = forward_backward(loop, tokens, counts, probe)
    names = ("output", "tokens' gradient", "fc1's weight gradient", "fc2's weight gradient")
    for name, mine, reference, magnitude in zip(names, ours, theirs, swiglu_magnitudes(loop, tokens, counts, probe)):
        assert_within(mine, reference, magnitude * (1 + 4 * BF16_U), BF16_U, k=32, name=name)
