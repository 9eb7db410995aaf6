"""The mixture-of-experts flags (Megatron-LM's names) and the `MoEConfig` they build."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron.core.transformer.moe.config import MoEConfig


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts (megatron/core/transformer/moe)")
    g.add_argument("--num-experts", type=int, help="Routed experts per MoE layer (unset: a dense model).")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="Inner width of each expert (default --ffn-hidden-size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="Inner width of a shared expert every token goes through (default: none).")
    g.add_argument("--moe-layer-freq", default="1",
                   help="Every N-th layer is MoE, or a 0/1 list per layer such as '[0]*1+[1]*27'.")
    g.add_argument("--moe-router-type", default="token_choice", choices=["token_choice", "expert_choice"],
                   help="token_choice (top-k experts per token) or expert_choice (top tokens per expert over "
                        "the sequence; diffusion modes only).")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts before the top-k (default: over the top-k logits).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, help="Multiplies the routing probabilities.")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Load-balancing loss weight.")
    g.add_argument("--moe-z-loss-coeff", type=float, help="Router z-loss weight (default: none).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing with a per-expert selection bias (sigmoid scores).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="Step of the expert-bias update.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="All local experts in one grouped GEMM (CUDA, bf16); otherwise one GEMM per expert.")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    g.add_argument("--moe-expert-capacity-factor", type=float,
                   help="Tokens per expert as a multiple of the balanced share; the rest are dropped "
                        "(default: dropless).")


def moe_config_from_args(args: argparse.Namespace) -> Optional[MoEConfig]:
    if args.num_experts is None:
        return None
    return MoEConfig(
        num_experts=args.num_experts, router_topk=args.moe_router_topk, ffn_hidden_size=args.moe_ffn_hidden_size,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size, layer_freq=args.moe_layer_freq,
        router_type=args.moe_router_type, router_score_function=args.moe_router_score_function,
        router_pre_softmax=args.moe_router_pre_softmax,
        router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        router_load_balancing_type=args.moe_router_load_balancing_type, aux_loss_coeff=args.moe_aux_loss_coeff,
        z_loss_coeff=args.moe_z_loss_coeff or 0.0, router_enable_expert_bias=args.moe_router_enable_expert_bias,
        router_bias_update_rate=args.moe_router_bias_update_rate, grouped_gemm=args.moe_grouped_gemm,
        token_dispatcher_type=args.moe_token_dispatcher_type, expert_capacity_factor=args.moe_expert_capacity_factor)


def validate_moe_args(args: argparse.Namespace) -> None:
    """What the MoE flags need of the rest of the run (after the configs are built)."""
    moe = args.moe_config
    if moe is None:
        for flag in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            if getattr(args, flag) != 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} needs MoE layers; "
                                 "add --num-experts or drop it")
        return
    # The dense FFN size as the config resolved it (--ffn-hidden-size defaults to 4 x --hidden-size).
    ffn = args.transformer_config.ffn_hidden_size
    moe.check_layout(ffn, args.tensor_model_parallel_size, args.expert_model_parallel_size,
                     args.expert_tensor_parallel_size, args.sequence_parallel)
    if moe.router_type == "expert_choice" and not args.dlm_config.is_diffusion:
        raise ValueError("--moe-router-type expert_choice picks tokens over the whole sequence, which under "
                         "--model-running-mode vanilla depends on future tokens; use token_choice or a diffusion mode")
    _validate_grouped_gemm(args, moe, ffn)


def _validate_grouped_gemm(args: argparse.Namespace, moe, ffn: int) -> None:
    """torch's grouped GEMM needs every row stride a multiple of 16 bytes: in bf16 the hidden size and each
    rank's share of the expert FFN a multiple of 8 (else CUDA stops mid-step with an alignment error)."""
    if not moe.grouped_gemm:
        return
    local_ffn = moe.expert_ffn_size(ffn) // args.expert_tensor_parallel_size
    for name, size in (("--hidden-size", args.hidden_size), ("the expert FFN size per expert-tensor-parallel rank "
                                                             "(--moe-ffn-hidden-size / --expert-tensor-parallel-size)",
                                                             local_ffn)):
        if size % 8:
            raise ValueError(f"--moe-grouped-gemm needs {name} divisible by 8 (it is {size}): torch's grouped GEMM "
                             "reads rows of 16-byte multiples; change the size or drop --moe-grouped-gemm")
