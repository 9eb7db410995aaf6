"""Precision and kernel flags: the fusions (Megatron's names), fp8 training and the precision-aware
optimizer's moment dtypes. Validation lives here (`validate_precision_args`) and with the flags they
depend on (arguments.FLAG_NEEDS, parallel_args.py for the layouts they support)."""

from __future__ import annotations

import argparse
from typing import Collection, List

import torch

from megatron.training.data_parallel_args import FSDP2_STRATEGIES

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
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"],
                   help="Train the transformer layers' linear layers in fp8 (with --bf16 or --fp16): e4m3 everywhere, "
                        "or hybrid (e5m2 output gradients). The layers run their float8 GEMMs from float8 working "
                        "copies of their weights (turns on --cache-low-precision-weights), under every parallel "
                        "layout but FSDP2.")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed"],
                   help="With --fp8-format: one dynamic scale per tensor from its own amax (the default here), or "
                        "delayed (Megatron-LM's default): each layer's input and output gradient cast by scales "
                        "from earlier iterations' amaxes (--fp8-amax-history-len, --fp8-amax-compute-algo, "
                        "--fp8-margin), the amax read in the cast's own pass.")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="--fp8-recipe delayed: iterations of amaxes each scale looks back over.")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="--fp8-recipe delayed: the scale's amax is the last iteration's or the history's largest.")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="--fp8-recipe delayed: scales divided by 2^margin (headroom for growing amaxes).")
    g.add_argument("--cache-low-precision-weights", action="store_true",
                   help="Under --bf16/--fp16 each linear layer keeps a working copy of its fp32 weight in the compute "
                        "dtype, refreshed after each optimizer step (written by --compile-optimizer-step's kernel), "
                        "instead of casting the weight in every micro-batch's forward. --fp8-format turns it on: "
                        "the copies are then float8 and the decoder's linear layers run their float8 GEMMs from "
                        "them.")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron's precision-aware optimizer: with --exp-avg-dtype / --exp-avg-sq-dtype bf16, "
                        "Adam's moments are stored in bf16 (the update computes in fp32; CompiledAdamW). Master "
                        "weights and gradients stay fp32.")
    for flag, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        g.add_argument(flag, choices=sorted(MOMENT_DTYPES), default="fp32",
                       help=f"With --use-precision-aware-optimizer: storage of Adam's {moment} moment.")


# The float8 layers run under bf16/fp16 autocast, from the working copies that the fp32 weight-gradient
# layers read (tensor_parallel/fp32_weight_grad.py): without either they would train in the compute dtype.
PRECISION_FLAG_NEEDS = (
    ("fp8_format", "--bf16 or --fp16", lambda a: a.bf16 or a.fp16),
    ("fp8_format", "gradient-accumulation fusion (drop --no-gradient-accumulation-fusion)",
     lambda a: a.gradient_accumulation_fusion),
)
# Notes, not errors (arguments.FLAG_NOTES): Megatron's default recipe is delayed, so its scripts pass
# these with --fp8-format alone.
PRECISION_FLAG_NOTES = tuple((dest, "--fp8-recipe delayed", lambda a: a.fp8_format is not None and
                              a.fp8_recipe == "delayed")
                             for dest in ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"))


def moment_dtypes(args: argparse.Namespace) -> dict:
    """OptimizerConfig's exp_avg_dtype and exp_avg_sq_dtype from the flags."""
    return {key: MOMENT_DTYPES[getattr(args, key)] for key in ("exp_avg_dtype", "exp_avg_sq_dtype")}


def validate_precision_args(args: argparse.Namespace, given: Collection[str]) -> List[str]:
    """--fp8-format's checks and what it turns on; returns the notes to print.

    Refuse float8 layers under --torch-compile on a CPU: torch 2.13's Inductor miscompiles them there
    (vectorized CPU code; with dropout and no linear biases every gradient turned NaN, where eager code,
    the aot_eager backend and unvectorized Inductor code trained right). The GPU's code is Triton's. Not
    under --check-args: the launch scripts' check may run where the training will not (a login node)."""
    if not args.fp8_format:
        return []
    if args.torch_compile and not (args.check_args or torch.cuda.is_available()):
        raise ValueError("--torch-compile with --fp8-format on a CPU: Inductor's CPU code computes NaN gradients "
                         "for the float8 layers (torch's bug); drop --torch-compile (float8 runs eagerly on a CPU)")
    delayed_scaling(args)  # raises on a bad history length or margin
    notes = _float8_weight_copies(args)
    if "fp8_recipe" not in given:
        notes.append(f"--fp8-recipe is {args.fp8_recipe} by default here, delayed in Megatron-LM; pass --fp8-recipe "
                     "delayed for Megatron's recipe (docs/megatron_compatibility.md)")
    return notes


def _float8_weight_copies(args: argparse.Namespace) -> List[str]:
    """The float8 layers read float8 working copies of their weights: --fp8-format turns the copies on."""
    strategy = args.data_parallel_sharding_strategy
    if strategy in FSDP2_STRATEGIES:
        raise ValueError(f"--fp8-format trains from float8 working copies of the weights, which FSDP2 "
                         f"(--data-parallel-sharding-strategy {strategy}) cannot keep (it gathers the weights in "
                         "bf16 itself); use --data-parallel-sharding-strategy optim (ZeRO-1) or drop --fp8-format")
    if args.cache_low_precision_weights:
        return []
    args.cache_low_precision_weights = True
    return ["--fp8-format turns on --cache-low-precision-weights: the decoder's linear layers run their float8 "
            "GEMMs from float8 working copies of their weights"]


def delayed_scaling(args: argparse.Namespace):
    """`--fp8-recipe delayed`'s settings (float8_scaling.DelayedScalingConfig), or None."""
    if not args.fp8_format or args.fp8_recipe != "delayed":
        return None
    from megatron.core.fp8.float8_scaling import DelayedScalingConfig

    return DelayedScalingConfig(args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.fp8_margin)


def precision_config(args: argparse.Namespace):
    """RunConfig.precision: the working copies, float8 and fp16's loss scaling from the flags."""
    from megatron.core.precision.apply import PrecisionConfig
    from megatron.core.precision.loss_scale import LossScaleConfig

    loss_scale = None
    if args.fp16:
        loss_scale = LossScaleConfig(args.initial_loss_scale, args.loss_scale, args.min_loss_scale,
                                     args.loss_scale_window, args.hysteresis)
    return PrecisionConfig(args.cache_low_precision_weights, args.fp8_format, args.fp8_recipe, delayed_scaling(args),
                           loss_scale)
