"""Training-step throughput of MegaDLMs, optionally next to a plain Hugging Face step of the same shape.

    python tools/benchmark/train_throughput.py --model qwen3-1.7b --mode dlm --seq-length 4096 --micro-batch-size 2 \
        --steps 20 [--warmup 5] [--baseline hf] [--fp8] [--torch-compile] [--masked-only-loss] [--compile-loss] \
        [--recompute {none,selective,full}] [--attention-backend auto] [--num-layers N] [--block-diffusion B] \
        [--profile DIR] [--json OUT]

    # OLMoE-1B-7B on one H200: ours grouped GEMM, ours per-expert loop, HF. 8 of its 16 layers peak at
    # 72 GB (12: 104 GB); all 6.9B parameters with AdamW need ~110 GB before any activation.
    python tools/benchmark/train_throughput.py --model olmoe-1b-7b --num-layers 8 --mode dlm --seq-length 4096 \
        --micro-batch-size 2 --steps 10 --warmup 3 --baseline hf --compare-grouped-gemm [--profile DIR]

The benchmark is the trainer: our row is `pretrain_difflm.py` in one process. Its options become
pretrain_difflm.py's flags (trainer_flags.py): the shape as the launch scripts write it (qwen3-1.7b is
examples/launch_common.sh's QWEN3_1P7B_SHAPE), `--mock-data`, in DLM mode the objective of
examples/dlm_training/dlm_pretrain_1.7b.sh (antithetic t, 1/p weights, B*L normalizer) at a fixed
length, `--bf16` on CUDA (fp32 on CPU), the launch scripts' AdamW, and each lever as the trainer flag
of its name (trainer_flags.lever_flags; `--loss-kernel` is `--difflm-loss-kernel`). `build_trainer`
(megatron/training/training.py) builds the trainer with pretrain_difflm's model provider, forward step
and datasets; each step is `Trainer.train_step` on the mock data, counted in the run's progress as
`train()` counts it (`Trainer.account`). The mock vocabulary is the shape's: `--vocab-size V-1
--add-mask-token` makes V ids with the mask token last, the rows of the transformers model (the
scripts' `--vocab-size V --add-mask-token` pads to V + 128).
Changed with the trainer: each of our rows prints its flags (`our row: python pretrain_difflm.py ...`)
and stores them in its JSON row as "pretrain_difflm_flags"; it trains on the trainer's mock data,
not on the baseline's random batches; its step synchronises the host once (the loss and grad norm
its skip decision reads), as training does; `--torch-compile-mode` is gone (the trainer compiles
its layers in torch.compile's default mode).

`--block-diffusion B` (DLM mode, no baseline) trains BD3-LM's objective (DLMConfig.block_diffusion):
the model reads [x_t ; x_0], 2L tokens under the block_diffusion mask, FLOPs counted so; tokens/s
counts the L tokens of x_0.

`--baseline hf` builds the equivalent transformers model (Qwen3ForCausalLM or LlamaForCausalLM,
random init, SDPA, fp32 weights under bf16 autocast, fused AdamW, eager; hf_baseline.py) and runs
the step a user would write on seeded random tokens: in DLM mode LLaDA's recipe (mask at rate
p = (1 - eps) t + eps, cross-entropy on the masked tokens weighted 1/p, divided by B*L) with
bidirectional attention, which is checked before timing; in AR mode the model's own shifted loss.

The MoE shapes (olmoe-1b-7b, olmoe-tiny; moe_models.py): ours is the trainer with
examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh's MoE flags, its experts one grouped GEMM per
projection (`--no-moe-grouped-gemm`: one GEMM per expert; `--compare-grouped-gemm`: both rows); the
baseline is OlmoeForCausalLM with its router balancing loss; moe_models.py says where the rows differ
(QK-norm over the whole projection in OLMoE, per head in ours; z-loss; the balancing loss's scale).

Each row is counted with the FLOPs formula of megatron/training/flops.py for the work it executes
(the one the console MFU uses; MoE layers by their active parameters): bidirectional attention
counts the full s keys, causal s/2; with --masked-only-loss our row's output layer runs at the
masked positions only (E[p] of them), the HF row's at every position. MFU is against the dense peak
of the card (H200: 989 TFLOP/s bf16, 1979 fp8); none on CPU. Step times are the median of the timed
steps (CUDA events on GPU, wall clock on CPU), after --warmup steps. The table gives each row's
tokens/s over the HF row's. `--accumulation N`: each step runs N micro-batches (forward and
backward), then one optimizer step (--global-batch-size N x --micro-batch-size).
`--profile DIR` then profiles 3 more steps of each row: where the time went (kernel_breakdown.py),
stored in the row's "profile", and a Chrome trace per row in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_breakdown  # noqa: E402
import moe_models  # noqa: E402
import trace_gaps  # noqa: E402
from trainer_flags import (PROFILED_STEPS, shape_flags, total_steps, training_args,  # noqa: E402, F401
                           training_flags)
from throughput_table import device_name, format_row, print_table, ratios, write_json  # noqa: E402, F401
from hf_baseline import (BETAS, CLIP_GRAD, DLM_EPS, LR, WEIGHT_DECAY, transformers_version,  # noqa: E402, F401
                         build_hf, hf_model, leaks_future, llada_loss, make_bidirectional, mask_token_id)

import pretrain_difflm  # noqa: E402
from custom_args.difflm import add_difflm_args  # noqa: E402
from megatron.core.distributed.data_parallel import unwrap  # noqa: E402
from megatron.core.parallel_state import destroy_model_parallel, model_parallel_is_initialized  # noqa: E402
from megatron.core.fp8.float8_matmul import GRADIENT_DTYPES  # noqa: E402
from megatron.core.transformer.transformer_config import (ATTENTION_BACKENDS, LOSS_KERNELS, DLMConfig,  # noqa: E402
                                                          TransformerConfig)
from megatron.training import flops  # noqa: E402
from megatron.training.initialize import Runtime, initialize_distributed  # noqa: E402
from megatron.training.precision_args import MOMENT_DTYPES  # noqa: E402
from megatron.training.run_config import parse_run_config  # noqa: E402
from megatron.training.training import Trainer, build_trainer  # noqa: E402



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


def transformer_config(spec: ModelSpec, device: torch.device, attention_backend: str = "auto") -> TransformerConfig:
    """The shape's TransformerConfig as pretrain_difflm.py builds it from `shape_flags` (bf16 on CUDA), for the
    benchmarks that build the model without the trainer (generation, evaluation, step_parts); every position
    the shape allows, and no id check that syncs the host (as the trainer's model_provider)."""
    flags = shape_flags(spec, spec.default_seq_length, spec.max_positions) + moe_models.moe_flags(spec.moe)
    flags += ["--moe-grouped-gemm"] if spec.moe is not None else []
    flags += (["--bf16"] if device.type == "cuda" else []) + ["--attention-backend", attention_backend]
    flags += ["--train-iters", "1"]  # the parser wants a run; the model never sees it
    return parse_run_config(flags, add_difflm_args, world_size=1).model.replace(check_token_ids=False)


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
    """`count` seeded [b, s] batches of ids below the mask token, made on the device before timing (the
    baseline's; our row reads the trainer's mock data)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, mask_token_id(spec), (micro_batch_size, seq_length), generator=generator).to(device)
            for _ in range(count)]


# ---------------------------------------------------------------------- the rows
@dataclass
class Arm:
    """One implementation, built: its model and optimizer, its step (step index) -> loss, and notes for its row."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[int], object]
    info: dict
    close: Callable[[], None] = lambda: None


@contextlib.contextmanager
def one_process(device: torch.device) -> Iterator[Runtime]:
    """The one-process group build_trainer runs in (as pretrain() starts it, on `device`); the group and the
    parallel layout are torn down afterwards where they were made here."""
    created, had_layout = not dist.is_initialized(), model_parallel_is_initialized()
    group = initialize_distributed("gloo" if device.type == "cpu" else None)
    try:
        yield Runtime(group.rank, group.world_size, group.local_rank, device)
    finally:
        if not had_layout:
            destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def build_ours(spec: ModelSpec, args: argparse.Namespace, device: torch.device, runtime: Runtime) -> Arm:
    """pretrain_difflm.py's trainer of `training_flags`: each step is Trainer.train_step on its mock data,
    then counted in the run's progress as train() counts it."""
    flags = training_flags(spec, args, device)
    print("our row: python pretrain_difflm.py " + " ".join(flags), flush=True)
    trainer = build_trainer(parse_run_config(flags, add_difflm_args, world_size=1), runtime,
                            pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                            pretrain_difflm.forward_step)
    trainer.model.train()
    data = trainer.hooks.data(trainer.train_loader(trainer.state.consumed_train_samples))

    def step(index: int) -> float:
        result = trainer.train_step(data)
        trainer.account(result)
        return result.loss

    model = unwrap(trainer.model)
    info = {**our_notes(trainer, model, args, device), "pretrain_difflm_flags": " ".join(flags)}
    return Arm(model, trainer.optimizer, step, info, close=trainer.logger.close)


def our_notes(trainer: Trainer, model: nn.Module, args: argparse.Namespace, device: torch.device) -> dict:
    """What the trainer built: float8 and compiled layers, working copies, the experts' GEMMs."""
    copies = trainer.weight_copies
    info = {"fp8_linears": copies.float8_layers if copies is not None else 0,
            "compiled_layers": sum(layer._compiled_call_impl is not None for layer in model.decoder.layers.values()),
            "masked_only_loss": args.masked_only_loss, "weight_copies": 0 if copies is None else len(copies.pairs)}
    if model.config.moe is not None:  # what was asked, and whether torch grouped_mm really runs here
        info.update(moe_grouped_gemm=args.moe_grouped_gemm, grouped_mm_kernel=moe_models.grouped_mm_kernel_runs(
            args.moe_grouped_gemm, device, model.config.bf16))
    return info


def build_baseline(spec: ModelSpec, args: argparse.Namespace, device: torch.device) -> Arm:
    """The transformers model's step (hf_baseline.py) on seeded random batches made before timing."""
    model, optimizer, step, info = build_hf(spec, args, device)
    batches = random_batches(spec, total_steps(args), args.micro_batch_size * args.accumulation, args.seq_length,
                             args.seed, device)
    return Arm(model, optimizer, lambda index: step(batches[index], index), info)


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


def time_steps(step: Callable[[int], object], count: int, warmup: int,
               device: torch.device) -> tuple[List[float], float]:
    """Milliseconds of steps `warmup` to `count` - 1 (after the first `warmup`), and the last loss.

    No synchronisation between timed steps beyond the step's own (the trainer reads its loss and grad
    norm once a step, as in training); CUDA events are read once at the end."""
    for index in range(warmup):
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    marks, loss = [], None
    for index in range(warmup, count):
        start = _mark(device)
        loss = step(index)
        marks.append((start, _mark(device)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [_milliseconds(start, end) for start, end in marks], float(loss)


def measure(name: str, build: Callable[[], Arm], args: argparse.Namespace, device: torch.device,
            flops_per_iteration: float, precision: str) -> dict:
    """Build one implementation, time its steps and return its row (the model is freed on return)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    arm = build()
    timed = args.warmup + args.steps
    times, loss = time_steps(arm.step, timed, args.warmup, device)
    median_ms = statistics.median(times)
    tokens = args.micro_batch_size * args.accumulation * args.seq_length
    peak = flops.peak_tflops(device_name(device), precision) if device.type == "cuda" else None
    metrics = flops.throughput_metrics(flops_per_iteration, tokens, median_ms / 1e3, world_size=1, peak=peak)
    row = {"name": name, "precision": precision, "parameters": sum(p.numel() for p in arm.model.parameters()),
           "step_ms": times, "median_step_ms": median_ms, **metrics, "peak_tflops": peak,
           "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None),
           "final_loss": loss, **arm.info}
    print(f"measured: {format_row(row)}", flush=True)  # each row as it comes, in case a later one fails
    if args.profile:  # after the timing, which the profiler would slow down
        os.makedirs(args.profile, exist_ok=True)
        trace = os.path.join(args.profile, "".join(c if c.isalnum() else "_" for c in name) + ".trace.json")
        with kernel_breakdown.moe_scopes(arm.model):  # MoE layers' ops, forward and backward, as "moe"
            row["profile"] = kernel_breakdown.profile_steps(arm.step, range(timed, total_steps(args)), device, trace,
                                                            args.profile_top)
        print(kernel_breakdown.format_table(name, row["profile"]), flush=True)
        if "gaps" in row["profile"]:
            print(trace_gaps.format_summary(row["profile"]["gaps"]), flush=True)
    arm.close()
    del arm
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
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile each of our transformer layers (the trainer's --torch-compile).")
    parser.add_argument("--masked-only-loss", action=argparse.BooleanOptionalAction, default=False,
                        help="Our output layer and cross-entropy at the loss positions only, in chunks.")
    parser.add_argument("--compile-loss", action="store_true",
                        help="With --masked-only-loss: the chunk's softmax and gradient as one compiled function "
                             "(DLMConfig.compile_loss).")
    parser.add_argument("--loss-kernel", choices=LOSS_KERNELS, default="triton",
                        help="With --compile-loss: the hand-written Triton kernel (the default, where Triton "
                             "runs) or torch.compile's kernel of the same function (--difflm-loss-kernel).")
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
                        help="A second row of ours with --fp8-format: the decoder's linears in float8 from float8 "
                             "working copies, under bf16 (on a CPU too, where float8 runs eagerly).")
    parser.add_argument("--fp8-format", choices=sorted(GRADIENT_DTYPES), default="hybrid",
                        help="With --fp8: gradients' type.")
    parser.add_argument("--fp8-recipe", choices=("tensorwise", "delayed"), default="tensorwise",
                        help="With --fp8: scaling (delayed: Megatron's recipe and defaults).")
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


def row_name(args: argparse.Namespace, fp8: bool, grouped: Optional[bool]) -> str:
    """Our row's name: MegaDLMs and the levers it runs with."""
    levers = [(fp8, " fp8"), (fp8 and args.fp8_recipe != "tensorwise", f" {args.fp8_recipe}"),
              (args.torch_compile, " compiled"), (args.masked_only_loss, " masked-only"),
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
    return "MegaDLMs" + "".join(label for on, label in levers if on)


def run(args: argparse.Namespace, spec: ModelSpec, device: torch.device, argv: List[str]) -> dict:
    """Time our step (and the baseline's) and collect everything the table and JSON show."""
    grouped_variants = moe_models.grouped_variants(args, spec)
    variants = [argparse.Namespace(**{**vars(args), "fp8": fp8, "moe_grouped_gemm": grouped})
                for fp8 in ([False, True] if args.fp8 else [False]) for grouped in grouped_variants]
    first = training_args(spec, variants[0], device)
    config, dlm = first.transformer_config, first.dlm_config
    step_flops = args.accumulation * flops_per_step(config, dlm, args.seq_length, args.micro_batch_size)
    # Hugging Face's step takes the logits of every position, whatever our row's loss path.
    hf_flops = args.accumulation * flops_per_step(config, dataclasses.replace(dlm, masked_only_loss=False),
                                                  args.seq_length, args.micro_batch_size)
    precision = "bf16" if device.type == "cuda" else "fp32"
    # With --fp8 our step runs without and with fp8, and with --compare-grouped-gemm with both expert
    # paths, so one command prints them all next to the baseline.
    with one_process(device) as runtime:
        rows = [measure(row_name(variant, variant.fp8, variant.moe_grouped_gemm),
                        functools.partial(build_ours, spec, variant, device, runtime), variant, device, step_flops,
                        "fp8" if variant.fp8 else precision) for variant in variants]
    if args.baseline == "hf":
        rows.append(measure("HF transformers", functools.partial(build_baseline, spec, args, device), args, device,
                            hf_flops, precision))
    return {
        "config": {"model": args.model, **dataclasses.asdict(spec), "mode": args.mode,
                   "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size, "steps": args.steps,
                   "accumulation": args.accumulation, "warmup": args.warmup, "baseline": args.baseline, "fp8": args.fp8,
                   "torch_compile": args.torch_compile, "masked_only_loss": args.masked_only_loss,
                   "compile_loss": args.compile_loss, "loss_kernel": args.loss_kernel,
                   "loss_chunk_size": args.loss_chunk_size, "compile_optimizer_step": args.compile_optimizer_step,
                   "recompute": args.recompute, "profile": args.profile, "attention_backend": args.attention_backend,
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
