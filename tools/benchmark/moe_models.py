"""The mixture-of-experts side of train_throughput.py: the MoE shapes, pretrain_difflm.py's MoE flags of
them, the transformers OLMoE baseline and the flags that choose between grouped GEMM and per-expert loop.

Ours: the trainer with `moe_flags` (those of examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh): every
layer MoE, token choice, dropless, no shared expert, the softmax over all experts before the top-k
(`--moe-router-pre-softmax`: OLMoE's norm_topk_prob=False), the load-balancing loss 0.01 and the router
z-loss 0.001 (OLMoE's recipe). The experts run as one grouped GEMM per projection (torch grouped_mm,
on CUDA in bf16; the default) or, with `--no-moe-grouped-gemm`, one GEMM per expert;
`--compare-grouped-gemm` times both. The row notes whether the grouped kernel really ran (`grouped_mm_kernel`: on CPU
both rows take the per-expert path).

HF: `OlmoeForCausalLM` of an `OlmoeConfig` of the same shape with output_router_logits=True and
router_aux_loss_coef 0.01. In AR mode its own loss, to which OlmoeForCausalLM.forward adds
router_aux_loss_coef x load_balancing_loss_func(router logits) when given labels; in DLM mode
the model is called without labels, so the same term is added to LLaDA's loss from
`outputs.router_logits` with transformers' own `load_balancing_loss_func` (with `switch_loss`,
a copy of its formula, where that cannot be imported). Its experts run as transformers'
default experts implementation, the one a plain user gets, unless `--hf-experts-implementation`
names another; the row records which ran. In transformers 5 the default is `grouped_mm`, which
casts the tokens to the weights' dtype: under autocast over fp32 weights torch runs it as its
fp32 fallback, a loop of fp32 GEMMs (on an H200, torch 2.11, transformers 5.17, OLMoE-1B-7B cut
to 8 layers: 621 ms a step, against 429 ms with `eager`, transformers' loop over the experts
hit, whose linears autocast runs in bf16). Time both when the baseline matters.

Where the rows differ, none of it counted by the FLOPs formula (matmuls only):
- QK-norm: OLMoE's q/k RMSNorm is over the whole projection (a x d and g x d wide), ours is per
  head (d wide, one weight shared by the heads): HF has (a + g - 2) x d more parameters a layer
  and reduces over the whole width.
- z-loss: transformers' OLMoE has none.
- balancing-loss scale: transformers' Switch loss is E x sum_e f_e P_e with f_e the share of
  assignments to expert e (summing to k), over every layer's tokens at once; ours is the same
  per layer with shares summing to 1, summed over the layers (Megatron's): at one coefficient
  ours is about L / k times transformers' (1x for OLMoE-1B-7B cut to 8 layers). Neither changes
  the step's work beyond a few small kernels.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn



@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a shape: every layer MoE, no shared expert (what OLMoE is)."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    pre_softmax: bool = True
    """Softmax over all experts, then the top-k (OLMoE: norm_topk_prob=False)."""
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.001
    """Ours only: transformers' OLMoE has no z-loss."""


# OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924): 64 experts of ffn 1024, top-8, in each of the 16 layers.
OLMOE_1B_7B = MoESpec(num_experts=64, topk=8, expert_ffn_hidden_size=1024)
# The same routing in miniature: 8 experts, top-2 (CPU tests, seconds).
OLMOE_TINY = MoESpec(num_experts=8, topk=2, expert_ffn_hidden_size=32)


def moe_flags(moe: Optional[MoESpec]) -> List[str]:
    """pretrain_difflm.py's MoE flags of the spec, as examples/dlm_training/dlm_pretrain_olmoe_1b_7b.sh writes
    them (token choice, dropless, single-process dispatch); none for a dense shape. The experts' GEMMs are
    train_throughput's lever (--moe-grouped-gemm)."""
    if moe is None:
        return []
    flags = ["--num-experts", moe.num_experts, "--moe-router-topk", moe.topk, "--moe-ffn-hidden-size",
             moe.expert_ffn_hidden_size, "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", moe.aux_loss_coeff, "--moe-z-loss-coeff", moe.z_loss_coeff]
    return [str(flag) for flag in flags] + (["--moe-router-pre-softmax"] if moe.pre_softmax else [])


def grouped_mm_kernel_runs(grouped_gemm: bool, device: torch.device, bf16: bool) -> bool:
    """Whether our experts take torch grouped_mm (experts.grouped_linear: CUDA, bf16 compute)."""
    return bool(grouped_gemm) and device.type == "cuda" and bf16 and hasattr(torch, "_grouped_mm")


# ---------------------------------------------------------------------- the transformers baseline
def olmoe_model(spec, experts_implementation: Optional[str] = None) -> nn.Module:
    """OlmoeForCausalLM of `spec` (a train_throughput.ModelSpec with `moe`): random init, SDPA,
    fp32 weights, router logits returned for the balancing loss."""
    import transformers

    moe = spec.moe
    if spec.kv_channels * spec.num_attention_heads != spec.hidden_size:
        raise ValueError(f"OLMoE's head dim is hidden / heads = {spec.hidden_size // spec.num_attention_heads}, "
                         f"not {spec.kv_channels}")
    chosen = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    config = transformers.OlmoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=moe.expert_ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, max_position_embeddings=spec.max_positions,
        rms_norm_eps=spec.norm_epsilon, rope_parameters={"rope_type": "default", "rope_theta": spec.rotary_base},
        tie_word_embeddings=spec.tied_embeddings, attention_bias=False, attention_dropout=0.0, clip_qkv=None,
        num_experts=moe.num_experts, num_experts_per_tok=moe.topk, norm_topk_prob=not moe.pre_softmax,
        output_router_logits=True, router_aux_loss_coef=moe.aux_loss_coeff, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, use_cache=False, attn_implementation="sdpa", **chosen)
    return transformers.OlmoeForCausalLM(config)


def experts_implementation(model: nn.Module) -> str:
    """The experts implementation transformers chose (older versions have only their loop)."""
    return getattr(model.config, "_experts_implementation", None) or "eager"


def switch_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` without attention mask (Switch Transformer eq. 4-6,
    every layer's tokens at once): E x sum_e (share of assignments to e) x (mean probability of e)."""
    probs = torch.softmax(torch.cat([logits.float() for logits in router_logits]), dim=-1)
    selected = probs.topk(top_k, dim=-1).indices
    tokens_per_expert = nn.functional.one_hot(selected, num_experts).float().mean(0)  # [k, E]
    return num_experts * (tokens_per_expert * probs.mean(0)).sum()


def router_aux_loss(model: nn.Module) -> Callable[[object], torch.Tensor]:
    """outputs -> router_aux_loss_coef x the balancing loss of `outputs.router_logits`, the term
    OlmoeForCausalLM.forward adds to the loss when given labels."""
    try:
        from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func
    except ImportError:
        load_balancing_loss_func = switch_loss
    config = model.config

    def aux_loss(outputs) -> torch.Tensor:
        balance = load_balancing_loss_func(tuple(outputs.router_logits), config.num_experts,
                                           config.num_experts_per_tok)
        return config.router_aux_loss_coef * balance

    return aux_loss


# ---------------------------------------------------------------------- flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                        help="MoE models: our experts as one grouped GEMM per projection (default), or one GEMM "
                             "per expert (--no-moe-grouped-gemm).")
    parser.add_argument("--compare-grouped-gemm", action="store_true",
                        help="MoE models: time our step with the grouped GEMM and with the per-expert loop.")
    parser.add_argument("--hf-experts-implementation",
                        help="MoE models with --baseline hf: transformers' experts implementation (eager, "
                             "grouped_mm, batched_mm, ...; default: transformers' default).")


def flag_error(args: argparse.Namespace, spec) -> Optional[str]:
    """The problem with the MoE flags for `spec`, or None; fills in --moe-grouped-gemm's default."""
    moe_flags = [name for name, given in (("--moe-grouped-gemm", args.moe_grouped_gemm is not None),
                                          ("--compare-grouped-gemm", args.compare_grouped_gemm),
                                          ("--hf-experts-implementation", args.hf_experts_implementation))
                 if given]
    if spec.moe is None:
        return f"{moe_flags[0]} needs an MoE --model (e.g. olmoe-1b-7b)" if moe_flags else None
    if args.compare_grouped_gemm and args.moe_grouped_gemm is not None:
        return "--compare-grouped-gemm times both our variants: drop --[no-]moe-grouped-gemm"
    if args.hf_experts_implementation and args.baseline != "hf":
        return "--hf-experts-implementation needs --baseline hf"
    if args.moe_grouped_gemm is None:
        args.moe_grouped_gemm = True
    return None


def grouped_variants(args: argparse.Namespace, spec) -> list:
    """Our rows' grouped-GEMM settings: [None] for a dense model, both with --compare-grouped-gemm."""
    if spec.moe is None:
        return [None]
    return [True, False] if args.compare_grouped_gemm else [args.moe_grouped_gemm]
