"""One-process training runs for the GPU parity suite, and the bounds they are held to.

Every test trains the same tiny model (2 layers, hidden 128, GQA with QK-norm, SwiGLU, tied
embeddings: the Llama/Qwen3 style the fused kernels serve) from the same weights on the same mock
batches and the same corruption (one seed) twice, on one device, through `build_trainer` and the
trainer's own step (2 micro-batches of 2 x 256 tokens a step, clipping at Megatron's 1.0, AdamW):

- the *fast* arm with what a user gets on a GPU: `--bf16`, `--attention-backend auto` (cuDNN SDPA
  or FlexAttention by mask), the fused loss (`--difflm-masked-only-loss --difflm-compile-loss`:
  the chunked output layer and the Triton softmax kernel), the SwiGLU kernel and gradient-
  accumulation fusion (both on by default), and per test `--torch-compile`, `--moe-grouped-gemm`,
  float8;
- the *reference* arm in fp32 with the explicit-softmax `math` attention, the full-logits loss and
  no fused kernel (`--no-bias-swiglu-fusion --no-gradient-accumulation-fusion`), TF32 off.

`compare` checks each step's loss, the step-1 grad norm and every parameter's step-1 gradient (as
the optimizer applies it: normalised and clipped). Later steps' gradients are not compared: AdamW's
first update is about lr * sign(g), so elements whose gradient is at rounding level move by 2 lr
apart and the arms' weights part by more than rounding; the losses of steps 2 and 3 still must agree.

Bounds (`Bound`): a growth factor times u, the unit roundoff of the narrowest type the fast arm
computes in (u = 2^-p for p significand bits: bf16 2^-8, float8 e4m3 2^-4, e5m2 2^-3, fp32 2^-24),
plus fp32's reordered sums: a sum of n terms in another order differs by about sqrt(n) u_fp32, and
the longest sums of a step have REDUCTION terms (that floor is what fp32 against fp32 is held to).

- A gradient tensor's relative error ||g - g_ref|| / ||g_ref|| <= GRADIENT_GROWTH (u + floor). In
  the bf16 arm each GEMM operand and each stored activation is rounded once, a relative error
  uniform in [-u, u] (RMS u / sqrt 3); a parameter's gradient lies behind K ~ 40 of them (about 8 a
  layer forward and 8 backward, 2 layers, the embedding, the norms and the loss). Independent
  roundings add in quadrature: sqrt(K / 3) u ~ 3.7 u (a CPU's bf16 autocast measured at most 3.3 u);
  GRADIENT_GROWTH = 16 is that times 4, for the softmax's and the norms' conditioning and the tail.
- Float8 against bf16 (FLOAT8_GRADIENT_GROWTH = 4): float8 rounds only the linear layers' GEMM
  operands, about 12 on a gradient's path (sqrt(12 / 3) = 2), times 2 for the tail (measured on a
  CPU: 1.8 u for e4m3, 0.9 u for hybrid).
- The step-1 grad norm: the gradient bound (no tensor's error exceeds it, so neither does the whole's).
- Each step's loss: relative error <= LOSS_GROWTH (u + floor), LOSS_GROWTH = 1/2. A token's loss
  moves by (p - y) . dz for logit errors dz of O(u) relative; at this initialisation the logits are
  below 1 in size against a loss of ~6, so even one token's relative error stays below u / 2
  (measured over the ~1000 tokens' mean: below u / 30).
- The reference's loss must move between the first and the last step by MOVEMENT = 5 loss bounds,
  so that a wrong optimizer step in the fast arm could not hide within the bound (the bf16 and
  fp32 comparisons; float8's loss bound is 16 times wider, and its optimizer is bf16's).

Mixture-of-experts runs replay the reference's routing (`RoutingReplay`): a rounding difference of
u flips a token's k-th expert where two gate logits lie within u of each other (85 of 4096 tokens
in a bf16 run on a CPU), which moves whole token contributions between experts, O(1) per flip;
identical routing keeps the comparison one of rounding. The gate still runs in both arms (its
weights' gradients, the routing weights and the balancing losses are compared).

MEGADLMS_GPU_SUITE_ON_CPU=1 runs the suite on a CPU, to debug it where there is no GPU: the fast
arm drops what needs CUDA or lowers the precision (`--bf16`, `--moe-grouped-gemm`, float8: see
`on_this_machine`), keeps the rest (SDPA for `auto`, the chunked loss with the Triton kernel under
Triton's interpreter, `--torch-compile` through Inductor's CPU code) and is held to fp32's bounds;
the float8 tests run float8 on the CPU (eagerly) against bf16 there.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.core.distributed.data_parallel import unwrap
from megatron.core.optimizer.optimizer import local_optimizers
from megatron.core.transformer.moe.router import Routing, TopKRouter
from megatron.training.initialize import Runtime, initialize_distributed
from megatron.training.run_config import parse_run_config
from megatron.training.training import build_trainer

ON_CPU = os.environ.get("MEGADLMS_GPU_SUITE_ON_CPU") == "1"
"""Run the suite on a CPU (to debug its plumbing where there is no GPU): see the module's docstring."""
DEVICE = torch.device("cpu" if ON_CPU else "cuda")

SUITE = [pytest.mark.gpu,
         pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                            reason="needs CUDA (MEGADLMS_GPU_SUITE_ON_CPU=1 runs it on a CPU, in fp32)")]
"""Every module's `pytestmark`."""

FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8
FLOAT8_UNIT_ROUNDOFF = {"e4m3": 2.0 ** -4, "hybrid": 2.0 ** -3}
"""--fp8-format's narrowest type: e4m3 (3 stored significand bits), hybrid's e5m2 gradients (2)."""
GRADIENT_GROWTH = 16.0
FLOAT8_GRADIENT_GROWTH = 4.0
LOSS_GROWTH = 0.5
MOVEMENT = 5.0
REDUCTION = 2 * 4 * 256
"""The most terms a sum of a step adds: 4 rows of 256 tokens, doubled by block diffusion's [x_t ; x_0]."""


@dataclass(frozen=True)
class Bound:
    """The relative bounds of one comparison (see the module's docstring)."""

    unit_roundoff: float
    gradient_growth: float = GRADIENT_GROWTH

    @property
    def floor(self) -> float:
        return math.sqrt(REDUCTION) * FP32_UNIT_ROUNDOFF

    @property
    def loss(self) -> float:
        return LOSS_GROWTH * (self.unit_roundoff + self.floor)

    @property
    def gradient(self) -> float:
        return self.gradient_growth * (self.unit_roundoff + self.floor)


def bound_of(flags: List[str]) -> Bound:
    """The bound of a fast arm (as it runs here) against the fp32 reference, or of a float8 arm
    against the bf16 one."""
    if "--fp8-format" in flags:
        return Bound(FLOAT8_UNIT_ROUNDOFF[flags[flags.index("--fp8-format") + 1]], FLOAT8_GRADIENT_GROWTH)
    return Bound(BF16_UNIT_ROUNDOFF if "--bf16" in flags else FP32_UNIT_ROUNDOFF)


STEPS = 3
SHAPE = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--normalization",
         "RMSNorm", "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--seq-length", "256",
         "--mock-data", "--vocab-size", "500", "--add-mask-token", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-decay-style", "constant",
         "--log-interval", "1000", "--eval-iters", "0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128", "--moe-aux-loss-coeff",
       "1e-2", "--moe-z-loss-coeff", "1e-3"]

FUSED_LOSS = ["--difflm-masked-only-loss", "--difflm-compile-loss"]
FAST = ["--bf16", "--attention-backend", "auto"] + FUSED_LOSS
"""A user's defaults on a GPU; the SwiGLU kernel and gradient-accumulation fusion are on by default."""
REFERENCE = ["--attention-backend", "math", "--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion"]
CUDA_ONLY = {"--bf16": 0, "--moe-grouped-gemm": 0, "--fp8-format": 1, "--fp8-recipe": 1,
             "--cache-low-precision-weights": 0}
"""Flags the fast arm drops on a CPU (MEGADLMS_GPU_SUITE_ON_CPU), with how many values each takes."""


def on_this_machine(flags: List[str]) -> List[str]:
    """`flags` as the fast arm runs them here: on a CPU without the CUDA-only and low-precision ones."""
    if not ON_CPU:
        return list(flags)
    kept, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag in CUDA_ONLY:
            skip = CUDA_ONLY[flag]
        else:
            kept.append(flag)
    return kept


@dataclass
class Run:
    """What one arm's training gave: per step loss and grad norm, every step's gradients."""

    losses: List[float]
    grad_norms: List[float]
    gradients: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, {parameter name: fp32 gradient on the CPU} as the optimizer applies it."""
    routing: List[torch.Tensor] = field(default_factory=list)
    """Every router call's chosen experts [tokens, k], in call order (MoE models)."""
    routing_flips: int = 0
    """Tokens whose experts this run would have chosen otherwise than the run it replayed."""
    compiled_layers: int = 0
    """Transformer layers torch.compile wraps (--torch-compile)."""
    float8_layers: int = 0
    """Linear layers that train in float8 (from float8 weight copies)."""


@contextlib.contextmanager
def isolated_state(device: torch.device):
    """No global state leaks out of a run: the RNGs (build_trainer seeds them), TF32 (off, so fp32
    means fp32), oneDNN (float8 on a CPU turns it off) and the compiler's caches."""
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    mkldnn = torch.backends.mkldnn.enabled
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.mkldnn.enabled = mkldnn
        torch._dynamo.reset()


def runtime() -> Runtime:
    """The one-process group on the suite's device."""
    group = initialize_distributed("gloo")
    return Runtime(group.rank, group.world_size, group.local_rank, DEVICE)


def applied_gradients(trainer) -> Dict[str, torch.Tensor]:
    """Every gradient as the coming optimizer step applies it: a fused AdamW divides by a scale it
    holds (the normaliser and the clipping, optimizer.scale_gradients), other steps read it scaled."""
    divisors = {}
    for part in local_optimizers(trainer.optimizer):
        scale = getattr(part, "grad_scale", None)
        for group in part.param_groups:
            divisors.update({id(param): scale for param in group["params"]})
    result = {}
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            grad, divisor = param.grad.detach().float(), divisors.get(id(param))
            result[name] = (grad if divisor is None else grad / divisor).cpu()
    return result


def train(flags: List[str], replay: Optional[Run] = None) -> Run:
    """Train `SHAPE + flags` for STEPS steps in this process on the suite's device; an MoE model
    routes every token as `replay` did (`RoutingReplay`)."""
    with isolated_state(DEVICE), RoutingReplay(replay.routing if replay else None) as routing:
        config = parse_run_config(SHAPE + list(flags), add_difflm_args, world_size=1)
        trainer = build_trainer(config, runtime(), pretrain_difflm.train_valid_test_datasets_provider,
                                pretrain_difflm.model_provider, pretrain_difflm.forward_step)
        run, step = Run([], []), trainer.optimizer.step

        def recording_step(*a, **k):
            run.gradients.append(applied_gradients(trainer))
            return step(*a, **k)

        trainer.optimizer.step = recording_step
        model = unwrap(trainer.model)
        run.compiled_layers = sum(layer._compiled_call_impl is not None for layer in model.decoder.layers.values())
        run.float8_layers = trainer.weight_copies.float8_layers if trainer.weight_copies is not None else 0
        trainer.train()
        trainer.logger.close()
    run.losses = [result.loss for result in trainer.history]
    run.grad_norms = [result.grad_norm for result in trainer.history]
    run.routing, run.routing_flips = routing.recorded, routing.flips
    return run


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def compare(fast: Run, reference: Run, bound: Bound, what: str) -> None:
    """The fast arm within `bound` of the reference: every step's loss, the step-1 grad norm and
    every step-1 gradient."""
    assert len(fast.losses) == len(reference.losses) == STEPS, (fast.losses, reference.losses)
    for step, (mine, theirs) in enumerate(zip(fast.losses, reference.losses), 1):
        assert abs(mine - theirs) <= bound.loss * abs(theirs), \
            f"{what} step {step}: loss {mine} vs the reference's {theirs} (bound {bound.loss:.2e} relative)"
    mine, theirs = fast.grad_norms[0], reference.grad_norms[0]
    assert abs(mine - theirs) <= bound.gradient * theirs, \
        f"{what}: step-1 grad norm {mine} vs the reference's {theirs} (bound {bound.gradient:.2e} relative)"
    expected, actual = reference.gradients[0], fast.gradients[0]
    assert set(actual) == set(expected) and expected, sorted(set(actual) ^ set(expected))
    errors = {name: relative_error(actual[name], grad) for name, grad in expected.items()}
    worst = sorted(errors.items(), key=lambda item: -item[1])[:4]
    assert worst[0][1] <= bound.gradient, \
        f"{what}: step-1 gradients beyond {bound.gradient:.2e} relative (worst first): {worst}"


def assert_loss_moves(reference: Run, bound: Bound) -> None:
    """The steps moved the loss by MOVEMENT bounds: an update gone wrong would show in the losses."""
    moved = abs(reference.losses[-1] - reference.losses[0])
    assert moved > MOVEMENT * bound.loss * abs(reference.losses[0]), \
        f"the loss moved by {moved} only ({reference.losses}): a wrong optimizer step could hide in the bound"


class RoutingReplay:
    """Every router call's chosen experts, recorded; given another run's record, the same experts
    chosen again, call by call (layers, micro-batches and steps come in the same order in both runs).
    The replaying run still computes its own gate logits: the chosen experts' weights are the softmax
    of its own logits at the recorded experts (the default token-choice router's rule), and its own
    choices are recorded too, so that `flips` counts the tokens it would have routed otherwise."""

    def __init__(self, replayed: Optional[List[torch.Tensor]] = None) -> None:
        self.replayed, self.recorded, self.flips = replayed, [], 0
        self.patch = pytest.MonkeyPatch()

    def __enter__(self) -> "RoutingReplay":
        original, replay = TopKRouter.route, self

        @torch.compiler.disable  # a graph break in a compiled MoE layer: the record is host state
        def route(router: TopKRouter, logits: torch.Tensor, shape) -> Routing:
            moe = router.moe
            assert (moe.router_score_function, moe.router_pre_softmax, moe.router_topk_scaling_factor,
                    moe.expert_capacity_factor, router.expert_bias) == ("softmax", False, None, None, None), \
                "RoutingReplay covers the default token-choice router only"
            return replay.route(original(router, logits, shape), logits)

        self.patch.setattr(TopKRouter, "route", route)
        return self

    def route(self, routing: Routing, logits: torch.Tensor) -> Routing:
        own = routing.top_indices.detach()
        self.recorded.append(own.clone())
        if self.replayed is None:
            return routing
        assert len(self.recorded) <= len(self.replayed), "more router calls than in the recorded run"
        indices = self.replayed[len(self.recorded) - 1].to(own.device)
        self.flips += int((own.sort(-1).values != indices.sort(-1).values).any(-1).sum())
        routing_map = torch.zeros_like(routing.routing_map).scatter(-1, indices, True)
        return Routing(routing_map, top_indices=indices, top_probs=torch.softmax(logits.gather(-1, indices), dim=-1))

    def __exit__(self, *exc) -> None:
        self.patch.undo()
        if exc[0] is None and self.replayed is not None:
            assert len(self.recorded) == len(self.replayed), \
                f"the replaying run routed {len(self.recorded)} times, the recorded one {len(self.replayed)}"
