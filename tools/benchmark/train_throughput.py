"""Training-step throughput of MegaDLMs, optionally next to a plain Hugging Face step of the same shape.

    python tools/benchmark/train_throughput.py --model qwen3-1.7b --mode dlm --seq-length 4096 --micro-batch-size 2 \
        --steps 20 [--warmup 5] [--baseline hf] [--fp8] [--torch-compile] [--masked-only-loss] [--compile-loss] \
        [--recompute {none,selective,full}] [--attention-backend auto] [--num-layers N] [--block-diffusion B] \
        [--profile DIR] [--json OUT]

    # OLMoE-1B-7B on one H200: ours grouped GEMM, ours per-expert loop, HF. 8 of its 16 layers peak at
    # 72 GB (12: 104 GB); all 6.9B parameters with AdamW need ~110 GB before any activation.
    python tools/benchmark/train_throughput.py --model olmoe-1b-7b --num-layers 8 --mode dlm --seq-length 4096 \
        --micro-batch-size 2 --steps 10 --warmup 3 --baseline hf --compare-grouped-gemm [--profile DIR]

Our row is the real thing on one device: `GPTModel` from `TransformerConfig`/`DLMConfig` (bf16
autocast over fp32 master weights on CUDA, fp32 on CPU), our AdamW (fused on GPU), and the
trainer's step on seeded random tokens (`training_step`: `compute_loss` builds the input, weights
and normalizer with `objective.loss_inputs`, as pretrain_difflm.forward_step does, each loss sum is
backpropagated, the normalizer folded into the clip and the step). The levers are
pretrain_difflm.py's flags (`--masked-only-loss`, `--torch-compile`, ...).

`--block-diffusion B` (DLM mode, no baseline) trains BD3-LM's objective (DLMConfig.block_diffusion):
the model reads [x_t ; x_0], 2L tokens under the block_diffusion mask, FLOPs counted so; tokens/s
counts the L tokens of x_0.

`--baseline hf` builds the equivalent transformers model (Qwen3ForCausalLM or LlamaForCausalLM,
random init, SDPA, fp32 weights under bf16 autocast, fused AdamW, eager) and runs the step a
user would write: in DLM mode LLaDA's recipe (mask at rate p = (1 - eps) t + eps, cross-entropy
on the masked tokens weighted 1/p, divided by B*L) with bidirectional attention, which is
checked before timing; in AR mode the model's own shifted loss.

The MoE shapes (olmoe-1b-7b, olmoe-tiny; moe_models.py): ours is `TransformerConfig(moe=MoEConfig(...))`,
its experts one grouped GEMM per projection (`--no-moe-grouped-gemm`: one GEMM per expert;
`--compare-grouped-gemm`: both rows); the baseline is OlmoeForCausalLM with its router balancing
loss; moe_models.py says where the rows differ (QK-norm over the whole projection in OLMoE, per
head in ours; z-loss; the balancing loss's scale).

Each row is counted with the FLOPs formula of megatron/training/flops.py for the work it executes
(the one the console MFU uses; MoE layers by their active parameters): bidirectional attention
counts the full s keys, causal s/2; with --masked-only-loss our row's output layer runs at the
masked positions only (E[p] of them), the HF row's at every position. MFU is against the dense peak
of the card (H200: 989 TFLOP/s bf16, 1979 fp8); none on CPU. Step times are the median of the timed
steps (CUDA events on GPU, wall clock on CPU), after --warmup steps. The table gives each row's
tokens/s over the HF row's. `--accumulation N`: each step runs N micro-batches (forward and
backward), then one optimizer step, as a global batch does.
`--profile DIR` then profiles 3 more steps of each row: where the time went (kernel_breakdown.py),
stored in the row's "profile", and a Chrome trace per row in DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_breakdown  # noqa: E402
import moe_models  # noqa: E402
import trace_gaps  # noqa: E402
from throughput_table import device_name, format_row, print_table, ratios, write_json  # noqa: E402, F401
from hf_baseline import (BETAS, CLIP_GRAD, DLM_EPS, LR, WEIGHT_DECAY, transformers_version,  # noqa: E402, F401
                         build_hf, hf_model, leaks_future, llada_loss, make_bidirectional, mask_token_id)

from megatron.core.models.difflm import diffusion  # noqa: E402
from megatron.core.models.difflm.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer.optimizer import (OptimizerConfig, build_optimizer, clip_grad_norm,  # noqa: E402
                                              forget_gradient_scale)
from megatron.core.tensor_parallel import fp32_weight_grad, linear_cross_entropy  # noqa: E402
from megatron.core.fp8.float8_scaling import DelayedScalingConfig  # noqa: E402
from megatron.core.precision.weight_copies import attach_weight_copies  # noqa: E402
from megatron.core.fp8.float8_matmul import GRADIENT_DTYPES, float8_gemms_on_cpu  # noqa: E402
from megatron.core.transformer.compilation import compile_transformer_layers  # noqa: E402
from megatron.core.transformer.transformer_config import (ATTENTION_BACKENDS, DLMConfig,  # noqa: E402
                                                          TransformerConfig)
from megatron.training import flops  # noqa: E402
from megatron.training.precision_args import MOMENT_DTYPES, moment_dtypes  # noqa: E402

PROFILED_STEPS = 3


class UsageError(Exception):
    """A bad flag combination: printed as one line, exit code 2."""


@dataclass(frozen=True)
class ModelSpec:
    """A named shape, and which transformers class is its plain equivalent."""

    family: str
    """'qwen3' (Qwen3ForCausalLM, QK-norm), 'llama' (LlamaForCausalLM) or 'olmoe' (OlmoeForCausalLM)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    rotary_base: float
    max_positions: int
    default_seq_length: int = 4096
    norm_epsilon: float = 1e-6
    moe: Optional[moe_models.MoESpec] = None
    """Routed experts in every layer (family 'olmoe'); ffn_hidden_size is then the experts' width."""

    @property
    def qk_layernorm(self) -> bool:
        return self.family in ("qwen3", "olmoe")


MODELS: Dict[str, ModelSpec] = {
    # Qwen3-1.7B: the shape of examples/dlm_training/dlm_pretrain_1.7b.sh.
    "qwen3-1.7b": ModelSpec("qwen3", 28, 2048, 16, 8, 128, 6144, 151936, True, 1e6, 40960),
    # Llama-3.2-1B (plain RoPE: the llama3 frequency scaling changes no FLOP and no kernel).
    "llama-1b": ModelSpec("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, 500000.0, 131072, norm_epsilon=1e-5),
    # The width of a 7-8B model (Llama-3-8B: GQA 32/8, SwiGLU 14336, untied) with 8 layers, so
    # weights, gradients and AdamW state (16 bytes a parameter, ~3B parameters) fit one H200.
    "7b-shape": ModelSpec("llama", 8, 4096, 32, 8, 128, 14336, 151936, False, 1e6, 32768),
    # A few hundred thousand parameters: runs on CPU in seconds (tests).
    "tiny": ModelSpec("qwen3", 2, 64, 4, 2, 16, 192, 1024, True, 10000.0, 256, default_seq_length=128),
    # OLMoE-1B-7B: MHA 16 x 128, QK-norm, 64 experts of ffn 1024, top-8 in all 16 layers, untied.
    "olmoe-1b-7b": ModelSpec("olmoe", 16, 2048, 16, 16, 128, 1024, 50304, False, 10000.0, 4096, norm_epsilon=1e-5,
                             moe=moe_models.OLMOE_1B_7B),
    # Its routing in miniature: 8 experts of ffn 32, top-2 (CPU tests, seconds).
    "olmoe-tiny": ModelSpec("olmoe", 2, 64, 4, 4, 16, 32, 1024, False, 10000.0, 256, default_seq_length=128,
                            norm_epsilon=1e-5, moe=moe_models.OLMOE_TINY)}


# ---------------------------------------------------------------------- configuration
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def transformer_config(spec: ModelSpec, device: torch.device, attention_backend: str = "auto",
                       recompute: str = "none", grouped_gemm: Optional[bool] = True, **fusions) -> TransformerConfig:
    """Our config of the shape; bf16 autocast over fp32 weights on CUDA, plain fp32 elsewhere. The
    batches are valid by construction, so (as in pretrain_difflm.py) no id check syncs the host.
    `recompute`: none, selective (core attention) or full (every layer, --recompute-method uniform
    --recompute-num-layers 1). `grouped_gemm`: MoE shapes' experts (moe_models.moe_config).
    `fusions`: TransformerConfig's fusion switches (gradient_accumulation_fusion, bias_swiglu_fusion;
    the config's defaults otherwise)."""
    full = recompute == "full"
    moe = moe_models.moe_config(spec.moe, bool(grouped_gemm)) if spec.moe is not None else None
    return TransformerConfig(
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None,
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels, ffn_hidden_size=spec.ffn_hidden_size,
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_positions, normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon, qk_layernorm=spec.qk_layernorm, gated_linear_unit=True,
        activation="silu", rotary_base=spec.rotary_base, share_embeddings_and_output_weights=spec.tied_embeddings,
        params_dtype=torch.float32, bf16=device.type == "cuda", attention_backend=attention_backend,
        check_token_ids=False, moe=moe, **fusions)


def dlm_config(spec: ModelSpec, mode: str, seed: int, masked_only_loss: bool = False,
               compile_loss: bool = False, block_diffusion: Optional[int] = None) -> DLMConfig:
    """The 1.7B launch script's objective (antithetic t, 1/p weights, B*L normalizer), fixed length;
    with `block_diffusion` B, BD3-LM's (t per block of B, [x_t ; x_0] under its mask)."""
    if mode == "ar":
        return DLMConfig(model_running_mode="vanilla", seed=seed, masked_only_loss=masked_only_loss,
                         compile_loss=compile_loss)
    return DLMConfig(model_running_mode="difflm-noshift", attention_mask_type="no_mask",
                     mask_token_id=mask_token_id(spec), eps=DLM_EPS, t_sampling="antithetic",
                     loss_weight="inverse_p", loss_normalizer="tokens", seed=seed,
                     masked_only_loss=masked_only_loss, compile_loss=compile_loss,
                     block_diffusion=block_diffusion is not None, block_size=block_diffusion)


def attention_mask_type(mode: str, block_diffusion: Optional[int] = None) -> str:
    """The mask the timed step runs under, as flops.py names it."""
    if block_diffusion is not None:
        return "block_diffusion"
    return "causal" if mode == "ar" else "no_mask"


def flops_per_step(config: TransformerConfig, dlm: DLMConfig, seq_length: int, micro_batch_size: int) -> float:
    """Model FLOPs one micro-batch of `dlm`'s objective executes (the output layer at the masked positions
    only under masked-only loss); under block diffusion `seq_length` is L, the forward runs 2L tokens."""
    return flops.executed_flops_per_iteration(config, dlm, seq_length, micro_batch_size)


def random_batches(spec: ModelSpec, count: int, micro_batch_size: int, seq_length: int, seed: int,
                   device: torch.device) -> List[torch.Tensor]:
    """`count` seeded [b, s] batches of ids below the mask token, made on the device before timing."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, mask_token_id(spec), (micro_batch_size, seq_length), generator=generator).to(device)
            for _ in range(count)]


# ---------------------------------------------------------------------- our step
def _compile_mode(args: argparse.Namespace) -> dict:
    """torch.compile's mode for the layers: none (its default), or the one --torch-compile-mode names."""
    return {} if args.torch_compile_mode == "default" else {"mode": args.torch_compile_mode}


def build_ours(spec: ModelSpec, args: argparse.Namespace, device: torch.device):
    """GPTModel, our optimizer, the step (batch, step index) -> detached loss, and notes for the row."""
    config = transformer_config(spec, device, args.attention_backend, args.recompute, args.moe_grouped_gemm,
                                gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                                bias_swiglu_fusion=args.bias_swiglu_fusion)
    dlm = dlm_config(spec, args.mode, args.seed, args.masked_only_loss, args.compile_loss, args.block_diffusion)
    dlm = dataclasses.replace(dlm, loss_chunk_size=args.loss_chunk_size)
    linear_cross_entropy.TRITON_KERNEL = args.loss_kernel == "triton"
    torch.manual_seed(args.seed)
    with torch.device(device):  # like build_trainer: no host-side init of billions of weights
        model = GPTModel(config, dlm)
    model = model.to(device).train()
    # fp8: the layers' own float8 GEMMs from float8 copies of their weights (which need bf16 compute)
    float8_copies = args.fp8 and config.bf16
    if args.fp8:
        float8_gemms_on_cpu(device)
    info = {"fp8_linears": 0,
            "compiled_layers": compile_transformer_layers(model, **_compile_mode(args)) if args.torch_compile else 0,
            "masked_only_loss": args.masked_only_loss}
    if spec.moe is not None:  # what was asked, and whether torch grouped_mm really runs here
        info.update(moe_grouped_gemm=args.moe_grouped_gemm,
                    grouped_mm_kernel=moe_models.grouped_mm_kernel_runs(args.moe_grouped_gemm, device, config.bf16))
    optimizer = build_optimizer(model, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
                                                       adam_beta2=BETAS[1], clip_grad=CLIP_GRAD,
                                                       compiled_step=args.compile_optimizer_step,
                                                       **moment_dtypes(args)))
    delayed = DelayedScalingConfig() if args.fp8 and args.fp8_recipe == "delayed" else None
    copies = (attach_weight_copies(model, optimizer, config.compute_dtype, args.fp8_format if args.fp8 else None,
                                   delayed) if (args.cache_low_precision_weights or float8_copies) and config.bf16
              else None)
    info["weight_copies"] = 0 if copies is None else len(copies.pairs)
    if float8_copies:
        info["fp8_linears"] = copies.float8_layers

    return model, optimizer, training_step(model, optimizer, copies, args, dlm.is_diffusion, device), info


def training_step(model, optimizer, copies, args: argparse.Namespace, diffusion_mode: bool, device: torch.device):
    """The trainer's step: --accumulation micro-batches, each backpropagating its loss sum, then one
    optimizer step with 1 / the step's normalizer folded into the clip and the fused AdamW
    (loss_normalization.py). (tokens, step index) -> the detached loss."""
    def step(tokens: torch.Tensor, index: int) -> torch.Tensor:
        if copies is not None:  # as the trainer does before each iteration
            copies.refresh()
        micro_batches, batch = tokens.split(args.micro_batch_size), args.micro_batch_size
        loss_sum = normalizer = 0.0
        for part, micro in enumerate(micro_batches):  # a new corruption every step, as in training
            key = diffusion.CorruptionKey.for_batch(
                args.seed, iteration=index, global_batch_size=batch * len(micro_batches),
                first_sample_index=(index * len(micro_batches) + part) * batch, batch_size=batch, device=device)
            with fp32_weight_grad.accumulating_into_grad():  # as the schedule in one process
                out = model.compute_loss(micro, key=key if diffusion_mode else None, normalize=False)
                out.loss_sum.backward()
            loss_sum, normalizer = loss_sum + out.loss_sum.detach(), normalizer + out.normalizer
        clip_grad_norm(model.parameters(), CLIP_GRAD, scale=1.0 / normalizer, optimizer=optimizer)
        optimizer.step()
        if copies is not None:
            copies.end_iteration()  # delayed scaling's update, as the trainer's
        forget_gradient_scale(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return loss_sum / normalizer
    return step


# ---------------------------------------------------------------------- timing and reporting
def _mark(device: torch.device):
    """A point in time: a CUDA event on the current stream (GPU time), else the wall clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _milliseconds(start, end) -> float:
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


def time_steps(step: Callable[[torch.Tensor, int], torch.Tensor], batches: List[torch.Tensor], warmup: int,
               device: torch.device) -> tuple[List[float], float]:
    """Milliseconds of every step after the first `warmup`, and the last loss.

    No synchronisation between timed steps (the host runs ahead as in training); CUDA events
    are read once at the end."""
    for index in range(warmup):
        step(batches[index], index)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    marks, loss = [], None
    for index in range(warmup, len(batches)):
        start = _mark(device)
        loss = step(batches[index], index)
        marks.append((start, _mark(device)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [_milliseconds(start, end) for start, end in marks], float(loss)


def measure(name: str, build: Callable, spec: ModelSpec, args: argparse.Namespace, device: torch.device,
            flops_per_iteration: float, precision: str) -> dict:
    """Build one implementation, time its steps and return its row (the model is freed on return)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer, step, info = build(spec, args, device)
    timed = args.warmup + args.steps
    batches = random_batches(spec, timed + (PROFILED_STEPS if args.profile else 0),
                             args.micro_batch_size * args.accumulation, args.seq_length, args.seed, device)
    times, loss = time_steps(step, batches[:timed], args.warmup, device)
    median_ms = statistics.median(times)
    tokens = args.micro_batch_size * args.accumulation * args.seq_length
    peak = flops.peak_tflops(device_name(device), precision) if device.type == "cuda" else None
    metrics = flops.throughput_metrics(flops_per_iteration, tokens, median_ms / 1e3, world_size=1, peak=peak)
    row = {"name": name, "precision": precision, "parameters": sum(p.numel() for p in model.parameters()),
           "step_ms": times, "median_step_ms": median_ms, **metrics, "peak_tflops": peak,
           "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None),
           "final_loss": loss, **info}
    print(f"measured: {format_row(row)}", flush=True)  # each row as it comes, in case a later one fails
    if args.profile:  # after the timing, which the profiler would slow down
        os.makedirs(args.profile, exist_ok=True)
        trace = os.path.join(args.profile, "".join(c if c.isalnum() else "_" for c in name) + ".trace.json")
        with kernel_breakdown.moe_scopes(model):  # MoE layers' ops, forward and backward, as "moe"
            row["profile"] = kernel_breakdown.profile_steps(step, batches[timed:], timed, device, trace,
                                                            args.profile_top)
        print(kernel_breakdown.format_table(name, row["profile"]), flush=True)
        if "gaps" in row["profile"]:
            print(trace_gaps.format_summary(row["profile"]["gaps"]), flush=True)
    del model, optimizer, step, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"One of {', '.join(MODELS)}.")
    parser.add_argument("--mode", choices=("dlm", "ar"), default="dlm",
                        help="dlm: masked diffusion, bidirectional attention; ar: next-token loss, causal.")
    parser.add_argument("--seq-length", type=int, help="Tokens per sequence (default: 4096; 128 for the tiny ones).")
    parser.add_argument("--num-layers", type=int, help="Fewer (or more) layers than the shape has, in both rows.")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1,
                        help="Micro-batches a step: N forward/backward passes, then one optimizer step.")
    parser.add_argument("--steps", type=int, default=20, help="Timed steps.")
    parser.add_argument("--warmup", type=int, default=5, help="Untimed steps first (allocator, autotuning, compile).")
    parser.add_argument("--baseline", choices=("none", "hf"), default="none",
                        help="hf: also time the equivalent transformers model in this process.")
    _add_precision_arguments(parser)
    parser.add_argument("--torch-compile", action="store_true", help="torch.compile each of our transformer layers.")
    parser.add_argument("--torch-compile-mode", default="default", choices=COMPILE_MODES,
                        help="With --torch-compile: torch.compile's mode for the layers (max-autotune-no-cudagraphs "
                             "tunes Triton GEMMs against cuBLAS: minutes of compile; reduce-overhead: CUDA graphs).")
    parser.add_argument("--masked-only-loss", action=argparse.BooleanOptionalAction, default=False,
                        help="Our output layer and cross-entropy at the loss positions only, in chunks.")
    parser.add_argument("--compile-loss", action="store_true",
                        help="With --masked-only-loss: the chunk's softmax and gradient as one compiled function "
                             "(DLMConfig.compile_loss).")
    parser.add_argument("--loss-kernel", choices=("triton", "inductor"), default="triton",
                        help="With --compile-loss: the hand-written Triton kernel (the default, where Triton "
                             "runs) or torch.compile's kernel of the same function.")
    parser.add_argument("--loss-chunk-size", type=int, default=DLMConfig.loss_chunk_size,
                        help="With --masked-only-loss: tokens per output-layer chunk (--difflm-loss-chunk-size).")
    parser.add_argument("--compile-optimizer-step", action="store_true",
                        help="Our AdamW step compiled (CompiledAdamW, --compile-optimizer-step) instead of fused.")
    parser.add_argument("--block-diffusion", type=int, metavar="B",
                        help="With --mode dlm: BD3-LM's objective with blocks of B tokens ([x_t ; x_0] under the "
                             "block_diffusion mask, DLMConfig.block_diffusion); B must divide --seq-length.")
    parser.add_argument("--profile", metavar="DIR",
                        help=f"After timing, profile {PROFILED_STEPS} more steps of each row: print the time "
                             "by attention/gemm/loss/optimizer/other, write Chrome traces to DIR.")
    parser.add_argument("--profile-top", type=int, default=kernel_breakdown.TOP_KERNELS, metavar="N",
                        help="With --profile: list the N longest kernels of each category.")
    parser.add_argument("--attention-backend", default="auto", help=f"One of {', '.join(ATTENTION_BACKENDS)}.")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="Our activation recompute: selective (core attention) or full (every layer).")
    parser.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                        action="store_false", help="Our weight gradients in bf16 then cast (plain autocast), "
                                                   "not written in fp32 by their GEMM.")
    parser.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                        help="Our SwiGLU as tensor math (fused by --torch-compile), not its Triton kernels.")
    parser.add_argument("--cache-low-precision-weights", action="store_true",
                        help="Our linear layers read bf16 working copies of their weights, written by the compiled "
                             "optimizer step (or refreshed before each step), instead of casting them each forward.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", help="Default: cuda when available, else cpu.")
    parser.add_argument("--json", help="Write every number, the exact config and versions here.")
    moe_models.add_arguments(parser)
    return parser


def _add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """The fp8 rows, and the storage of our AdamW's moments."""
    parser.add_argument("--fp8", action="store_true",
                        help="float8 training of our decoder's linears from float8 copies of their weights "
                             "(bf16: CUDA only).")
    parser.add_argument("--fp8-format", choices=tuple(GRADIENT_DTYPES), default="hybrid",
                        help="With --fp8: gradients' type.")
    parser.add_argument("--fp8-recipe", choices=("tensorwise", "delayed"), default="tensorwise",
                        help="With --fp8: scaling (delayed: Megatron's defaults).")
    for flag, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        parser.add_argument(flag, choices=sorted(MOMENT_DTYPES), default="fp32",
                            help=f"Storage of our AdamW's {moment} moment (Megatron's precision-aware optimizer; "
                                 "bf16 takes the compiled step).")


def validate(args: argparse.Namespace) -> ModelSpec:
    """The spec of --model with --seq-length filled in; UsageError on a bad combination."""
    if args.model not in MODELS:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(MODELS)}")
    spec = MODELS[args.model]
    if args.profile_top < 1:
        raise UsageError(f"--profile-top {args.profile_top} must be at least 1")
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise UsageError(f"--num-layers {args.num_layers} must be at least 1")
        spec = dataclasses.replace(spec, num_layers=args.num_layers)
    if args.seq_length is None:
        args.seq_length = spec.default_seq_length
    if args.seq_length < 1 or args.seq_length > spec.max_positions:
        raise UsageError(f"--seq-length {args.seq_length} is outside [1, {spec.max_positions}], the max positions "
                         f"of {args.model}; pass a shorter --seq-length")
    if args.compile_loss and not args.masked_only_loss:
        raise UsageError("--compile-loss needs --masked-only-loss")
    if args.loss_chunk_size < 1:
        raise UsageError(f"--loss-chunk-size {args.loss_chunk_size} must be at least 1")
    if args.torch_compile_mode != "default" and not args.torch_compile:
        raise UsageError(f"--torch-compile-mode {args.torch_compile_mode} needs --torch-compile")
    for error in (_block_diffusion_error(args), moe_models.flag_error(args, spec)):
        if error:
            raise UsageError(error)
    for flag, least in (("micro_batch_size", 1), ("steps", 1), ("accumulation", 1), ("warmup", 0)):
        if getattr(args, flag) < least:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least {least}")
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise UsageError(f"--attention-backend {args.attention_backend!r} is not one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if args.baseline == "hf" and transformers_version() is None:
        raise UsageError("--baseline hf needs the transformers package: pip install transformers")
    if args.fp8 and _device(args).type != "cuda":
        raise UsageError("--fp8 runs our float8 layers under bf16, which this benchmark computes on CUDA only; "
                         "drop --fp8 or run on a GPU")
    return spec


def _block_diffusion_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with --block-diffusion in this combination, or None."""
    block = args.block_diffusion
    if block is not None and args.mode != "dlm":
        return f"--block-diffusion needs --mode dlm (got --mode {args.mode})"
    if block is not None and (block < 1 or args.seq_length % block):
        return f"--block-diffusion {block} must be a positive divisor of --seq-length {args.seq_length}"
    return ("--block-diffusion has no Hugging Face equivalent; drop --baseline hf"
            if block is not None and args.baseline == "hf" else None)


def run(args: argparse.Namespace, spec: ModelSpec, device: torch.device, argv: List[str]) -> dict:
    """Time our step (and the baseline's) and collect everything the table and JSON show."""
    grouped_variants = moe_models.grouped_variants(args, spec)
    config = transformer_config(spec, device, args.attention_backend, grouped_gemm=grouped_variants[0])
    dlm = dlm_config(spec, args.mode, args.seed, args.masked_only_loss, block_diffusion=args.block_diffusion)
    step_flops = args.accumulation * flops_per_step(config, dlm, args.seq_length, args.micro_batch_size)
    # Hugging Face's step takes the logits of every position, whatever our row's loss path.
    hf_flops = args.accumulation * flops_per_step(config, dataclasses.replace(dlm, masked_only_loss=False),
                                                  args.seq_length, args.micro_batch_size)
    precision = "bf16" if device.type == "cuda" else "fp32"
    rows = []
    # With --fp8 our step runs without and with fp8, and with --compare-grouped-gemm with both expert
    # paths, so one command prints them all next to the baseline.
    for fp8 in ([False, True] if args.fp8 else [False]):
        for grouped in grouped_variants:
            variant = argparse.Namespace(**{**vars(args), "fp8": fp8, "moe_grouped_gemm": grouped})
            levers = [(fp8, " fp8"), (fp8 and args.fp8_recipe != "tensorwise", f" {args.fp8_recipe}"),
                      (args.torch_compile, " compiled"), (args.masked_only_loss, " masked-only"),
                      (args.torch_compile_mode != "default", f" {args.torch_compile_mode}"),
                      (args.compile_loss, " compiled-loss"),
                      (args.compile_loss and args.loss_kernel == "inductor", " (inductor kernel)"),
                      (args.loss_chunk_size != DLMConfig.loss_chunk_size, f" chunk-{args.loss_chunk_size}"),
                      (args.compile_optimizer_step, " compiled-optimizer"),
                      (args.recompute != "none", f" recompute-{args.recompute}"),
                      (not args.gradient_accumulation_fusion, " no-grad-accum-fusion"),
                      (not args.bias_swiglu_fusion, " no-swiglu-fusion"),
                      (args.cache_low_precision_weights, " weight-copies"),
                      (args.exp_avg_dtype != "fp32", f" exp-avg-{args.exp_avg_dtype}"),
                      (args.exp_avg_sq_dtype != "fp32", f" exp-avg-sq-{args.exp_avg_sq_dtype}"),
                      (grouped is True, " grouped-gemm"), (grouped is False, " per-expert-loop"),
                      (args.block_diffusion is not None, f" block-diffusion-{args.block_diffusion}")]
            rows.append(measure("MegaDLMs" + "".join(label for on, label in levers if on),
                                build_ours, spec, variant, device, step_flops, "fp8" if fp8 else precision))
    if args.baseline == "hf":
        rows.append(measure("HF transformers", build_hf, spec, args, device, hf_flops, precision))
    return {
        "config": {"model": args.model, **dataclasses.asdict(spec), "mode": args.mode,
                   "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size, "steps": args.steps,
                   "accumulation": args.accumulation, "warmup": args.warmup, "baseline": args.baseline, "fp8": args.fp8,
                   "torch_compile": args.torch_compile, "torch_compile_mode": args.torch_compile_mode,
                   "masked_only_loss": args.masked_only_loss, "compile_loss": args.compile_loss,
                   "loss_kernel": args.loss_kernel, "loss_chunk_size": args.loss_chunk_size,
                   "compile_optimizer_step": args.compile_optimizer_step, "recompute": args.recompute,
                   "profile": args.profile, "attention_backend": args.attention_backend,
                   "moe_grouped_gemm": args.moe_grouped_gemm, "compare_grouped_gemm": args.compare_grouped_gemm,
                   "hf_experts_implementation": args.hf_experts_implementation,
                   "block_diffusion": args.block_diffusion, "seed": args.seed},
        "transformer_config": {name: str(value) if isinstance(value, torch.dtype) else value
                               for name, value in dataclasses.asdict(config).items()},
        "attention_mask_type": attention_mask_type(args.mode, args.block_diffusion),
        "flops_per_step": step_flops, "hf_flops_per_step": hf_flops if args.baseline == "hf" else None,
        "tokens_per_step": args.micro_batch_size * args.accumulation * args.seq_length,
        "rows": rows, **ratios(rows, args.baseline == "hf", args.fp8, len(grouped_variants)),
        "command": " ".join(["python", os.path.relpath(__file__, ROOT), *argv]),
        "torch_version": torch.__version__, "transformers_version": transformers_version(),
        "device": device_name(device) or "cpu",
    }


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def main(argv: Optional[List[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    device = _device(args)
    if device.type == "cuda" and device.index is None:  # the memory-stats calls want an index
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        spec = validate(args)
    except UsageError as error:
        print(f"train_throughput.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = run(args, spec, device, argv)
    print_table(result)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
