"""Precision and kernel flags: the fusions (Megatron's names), fp8 training and the precision-aware
optimizer's moment dtypes. Validation lives with the flags they depend on (arguments.FLAG_NEEDS,
parallel_args.py for the layouts they support)."""

from __future__ import annotations

import argparse

import torch

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""--exp-avg-dtype / --exp-avg-sq-dtype: the storage of Adam's moments."""


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("precision and kernels")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="Under bf16/fp16 the weight-gradient GEMMs of the linear layers write fp32 (cuBLAS, on CUDA); "
                        "this flag makes them write the compute dtype and cast, as plain autocast does.")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="SwiGLU runs as plain tensor math instead of its Triton kernels (used on CUDA where Triton "
                        "is installed).")
    g.add_argument("--rmsnorm-fusion", action="store_true",
                   help="RMSNorm's forward and backward as Triton kernels (the input's and the weight's gradients "
                        "in one pass; used on CUDA where Triton is installed) instead of the tensor math. Under "
                        "--torch-compile it measured 1.6%% slower (it ends the compiler's fusions across the norm).")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"],
                   help="Train the transformer layers' linear layers in fp8: e4m3 everywhere, or hybrid (e5m2 output "
                        "gradients). Through torchao's float8 linears, or with --cache-low-precision-weights through "
                        "float8 working copies of the weights (no torchao needed; the only path under tensor or "
                        "context parallelism).")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "delayed"],
                   help="With --fp8-format: one dynamic scale per tensor, or per row; or delayed (Megatron's "
                        "recipe, with --cache-low-precision-weights): each layer's input and output gradient cast "
                        "by scales from earlier iterations' amaxes (--fp8-amax-history-len, "
                        "--fp8-amax-compute-algo, --fp8-margin), the amax read in the cast's own pass.")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="--fp8-recipe delayed: iterations of amaxes each scale looks back over.")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="--fp8-recipe delayed: the scale's amax is the last iteration's or the history's largest.")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="--fp8-recipe delayed: scales divided by 2^margin (headroom for growing amaxes).")
    g.add_argument("--fp8-output-layer", action="store_true",
                   help="With --fp8-format and --difflm-masked-only-loss: the output layer's logits and input-"
                        "gradient GEMMs in float8 too (tensorwise; the weight gradient stays in the compute dtype).")
    g.add_argument("--cache-low-precision-weights", action="store_true",
                   help="Under --bf16/--fp16 each linear layer keeps a working copy of its fp32 weight in the compute "
                        "dtype, refreshed after each optimizer step (written by --compile-optimizer-step's kernel), "
                        "instead of casting the weight in every micro-batch's forward. Under --fp8-format the "
                        "copies are float8 and the decoder's linear layers run their float8 GEMMs themselves "
                        "instead of through torchao (the tensorwise or delayed recipe).")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron's precision-aware optimizer: with --exp-avg-dtype / --exp-avg-sq-dtype bf16, "
                        "Adam's moments are stored in bf16 (the update computes in fp32; CompiledAdamW). Master "
                        "weights and gradients stay fp32.")
    for flag, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        g.add_argument(flag, choices=sorted(MOMENT_DTYPES), default="fp32",
                       help=f"With --use-precision-aware-optimizer: storage of Adam's {moment} moment.")


# Notes, not errors (arguments.FLAG_NOTES): Megatron's default recipe is delayed, so its scripts pass
# these with --fp8-format alone.
PRECISION_FLAG_NOTES = tuple((dest, "--fp8-recipe delayed", lambda a: a.fp8_format is not None and
                              a.fp8_recipe == "delayed")
                             for dest in ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"))


def moment_dtypes(args: argparse.Namespace) -> dict:
    """OptimizerConfig's exp_avg_dtype and exp_avg_sq_dtype from the flags."""
    return {key: MOMENT_DTYPES[getattr(args, key)] for key in ("exp_avg_dtype", "exp_avg_sq_dtype")}


def validate_precision_args(args: argparse.Namespace) -> None:
    """Refuse float8 layers under --torch-compile on a CPU: torch 2.13's Inductor miscompiles them there
    (vectorized CPU code; with dropout and no linear biases every gradient turned NaN, where eager code,
    the aot_eager backend and unvectorized Inductor code trained right). The GPU's code is Triton's. Not
    under --check-args: the launch scripts' check may run where the training will not (a login node)."""
    if args.fp8_format and args.torch_compile and not (args.check_args or torch.cuda.is_available()):
        raise ValueError("--torch-compile with --fp8-format on a CPU: Inductor's CPU code computes NaN gradients "
                         "for the float8 layers (torch's bug); drop --torch-compile (float8 runs eagerly on a CPU)")


def delayed_scaling(args: argparse.Namespace):
    """`--fp8-recipe delayed`'s settings (float8_scaling.DelayedScalingConfig), or None."""
    if not args.fp8_format or args.fp8_recipe != "delayed":
        return None
    from megatron.core.fp8.float8_scaling import DelayedScalingConfig

    return DelayedScalingConfig(args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.fp8_margin)
