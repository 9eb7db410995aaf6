"""train_throughput.py's options as pretrain_difflm.py's flags: our row is the trainer those flags build.

The shape as the launch scripts write it (qwen3-1.7b at 4096 is examples/launch_common.sh's
QWEN3_1P7B_SHAPE; the MoE shapes add moe_models.moe_flags, those of
examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh) over `--mock-data` of the shape's vocabulary; in DLM
mode the objective of examples/dlm_training/dlm_pretrain_1.7b.sh at a fixed length; each lever its
trainer flag (`lever_flags`); the launch scripts' AdamW; a global batch of --accumulation micro-batches;
no evaluation. `spec` is a train_throughput.ModelSpec.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch

import moe_models
from custom_args.difflm import add_difflm_args
from hf_baseline import BETAS, CLIP_GRAD, DLM_EPS, LR, WEIGHT_DECAY
from megatron.training.arguments import parse_args

PROFILED_STEPS = 3
"""Steps each row runs after the timed ones with --profile."""


def _words(*values) -> List[str]:
    return [str(value) for value in values]


def shape_flags(spec, seq_length: int, max_positions: Optional[int] = None) -> List[str]:
    """The shape as pretrain_difflm.py's flags, written as the launch scripts write it (qwen3-1.7b at 4096 is
    examples/launch_common.sh's QWEN3_1P7B_SHAPE), over mock data of the shape's vocabulary (the mask token
    its last id). `max_positions`: --max-position-embeddings (default `seq_length`, as the scripts)."""
    flags = _words("--num-layers", spec.num_layers, "--hidden-size", spec.hidden_size,
                   "--ffn-hidden-size", spec.ffn_hidden_size, "--num-attention-heads", spec.num_attention_heads)
    if spec.num_query_groups != spec.num_attention_heads:
        flags += _words("--group-query-attention", "--num-query-groups", spec.num_query_groups)
    flags += _words("--kv-channels", spec.kv_channels, "--seq-length", seq_length,
                    "--max-position-embeddings", max_positions or seq_length, "--position-embedding-type", "rope",
                    "--rotary-base", f"{spec.rotary_base:g}", "--normalization", "RMSNorm",
                    "--norm-epsilon", f"{spec.norm_epsilon:g}")
    flags += ["--qk-layernorm"] if spec.qk_layernorm else []
    flags += ["--swiglu", "--disable-bias-linear"]
    flags += [] if spec.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    flags += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.02"]
    # V - 1 ids and an appended mask token: V rows (a multiple of 128, so no padding), the mask last.
    return flags + _words("--mock-data", "--vocab-size", spec.vocab_size - 1, "--add-mask-token")


def objective_flags(args: argparse.Namespace) -> List[str]:
    """dlm: the objective of examples/dlm_training/dlm_pretrain_1.7b.sh at a fixed length; ar: the next-token
    loss. Then the loss levers."""
    if args.mode == "ar":
        flags = ["--model-running-mode", "vanilla"]
    else:
        flags = _words("--model-running-mode", "difflm-noshift", "--attention-mask-type", "no_mask",
                       "--difflm-eps", DLM_EPS, "--difflm-t-sampling", "antithetic",
                       "--difflm-loss-weight", "inverse_p", "--difflm-loss-normalizer", "tokens")
    if args.block_diffusion is not None:
        flags += _words("--difflm-block-diffusion", "--difflm-block-size", args.block_diffusion)
    if args.masked_only_loss:
        flags += _words("--difflm-masked-only-loss", "--difflm-loss-chunk-size", args.loss_chunk_size)
    if args.compile_loss:
        flags += ["--difflm-compile-loss", "--difflm-loss-kernel", args.loss_kernel]
    return flags


def lever_flags(args: argparse.Namespace, device: torch.device) -> List[str]:
    """Precision, attention, recompute, compilation, fusions, optimizer storage, float8 and the experts."""
    bf16 = device.type == "cuda"
    flags = (["--bf16"] if bf16 else []) + ["--attention-backend", args.attention_backend]
    if args.recompute != "none":
        flags += ["--recompute-granularity", args.recompute]
        flags += ["--recompute-method", "uniform", "--recompute-num-layers", "1"] if args.recompute == "full" else []
    switches = [(args.torch_compile, "--torch-compile"), (args.compile_optimizer_step, "--compile-optimizer-step"),
                (not args.gradient_accumulation_fusion, "--no-gradient-accumulation-fusion"),
                (not args.bias_swiglu_fusion, "--no-bias-swiglu-fusion"),
                # working copies need a low-precision compute type: none on a CPU's fp32
                (args.cache_low_precision_weights and bf16, "--cache-low-precision-weights"),
                (bool(args.moe_grouped_gemm), "--moe-grouped-gemm")]
    flags += [flag for on, flag in switches if on]
    if (args.exp_avg_dtype, args.exp_avg_sq_dtype) != ("fp32", "fp32"):
        flags += ["--use-precision-aware-optimizer", "--exp-avg-dtype", args.exp_avg_dtype,
                  "--exp-avg-sq-dtype", args.exp_avg_sq_dtype]
    if args.fp8:
        # our float8 layers run under bf16 autocast (on a CPU too, eagerly): the fp8 row computes in bf16
        flags += ([] if bf16 else ["--bf16"]) + ["--fp8-format", args.fp8_format, "--fp8-recipe", args.fp8_recipe]
    return flags


def total_steps(args: argparse.Namespace) -> int:
    """Steps each row runs: warm-up, timed and, with --profile, profiled."""
    return args.warmup + args.steps + (PROFILED_STEPS if args.profile else 0)


def training_flags(spec, args: argparse.Namespace, device: torch.device) -> List[str]:
    """pretrain_difflm.py's flags of our row: shape, objective, levers, and the run: the launch scripts'
    AdamW, a global batch of --accumulation micro-batches, no evaluation."""
    run = _words("--micro-batch-size", args.micro_batch_size, "--global-batch-size",
                 args.micro_batch_size * args.accumulation, "--train-iters", total_steps(args), "--lr", LR,
                 "--weight-decay", WEIGHT_DECAY, "--adam-beta1", BETAS[0], "--adam-beta2", BETAS[1],
                 "--clip-grad", CLIP_GRAD, "--eval-iters", 0, "--seed", args.seed)
    return shape_flags(spec, args.seq_length) + moe_models.moe_flags(spec.moe) + objective_flags(args) + \
        lever_flags(args, device) + run


def training_args(spec, args: argparse.Namespace, device: torch.device) -> argparse.Namespace:
    """pretrain_difflm.py's parsed arguments of our row (its transformer_config, dlm_config, ...)."""
    return parse_args(training_flags(spec, args, device), add_difflm_args, world_size=1)
