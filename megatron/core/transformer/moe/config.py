"""Typed configuration of the mixture-of-experts layers (`TransformerConfig.moe`).

Every field is Megatron-LM's flag `--moe-<field>` (`num_experts` is `--num-experts`);
`validate()` raises one `ValueError` per problem that names the field (`MoEConfig.<field>`)
and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

ROUTER_TYPES = ("token_choice", "expert_choice")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHER_TYPES = ("allgather", "alltoall")


def parse_layer_freq(value: Union[int, str, Sequence[int]], num_layers: int) -> List[int]:
    """Megatron's `--moe-layer-freq`: an int N (every N-th layer, from layer 0, is MoE) or a list
    of 0/1 per layer, written as a Python list expression such as `[0]*1+[1]*27` (parsed, never
    evaluated)."""
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        freq = int(value)
        if freq < 1:
            raise ValueError(f"MoEConfig.layer_freq={value!r} must be >= 1")
        return [1 if index % freq == 0 else 0 for index in range(num_layers)]
    flags = list(value) if not isinstance(value, str) else _parse_list_expression(value)
    if len(flags) != num_layers or any(flag not in (0, 1) for flag in flags):
        raise ValueError(f"MoEConfig.layer_freq={value!r} must give a 0 or 1 for each of the {num_layers} layers "
                         "(e.g. [0]*1+[1]*27)")
    return flags


def _parse_list_expression(text: str) -> List[int]:
    flags: List[int] = []
    for term in text.replace(" ", "").split("+"):
        match = re.fullmatch(r"\[([0-9,]*)\](?:\*([0-9]+))?", term)
        if match is None:
            raise ValueError(f"MoEConfig.layer_freq={text!r}: {term!r} is not a list like [0,1] or [1]*27")
        items = [int(item) for item in match.group(1).split(",") if item]
        flags += items * int(match.group(2) or 1)
    return flags


@dataclass
class MoEConfig:
    """Routed experts (and optional shared experts) in the MLP slot of the MoE layers."""

    num_experts: int = 8
    """Routed experts per MoE layer (--num-experts)."""
    router_topk: int = 2
    """Experts per token (token choice); under expert choice, the average experts per token that
    sets each expert's capacity (capacity = tokens x topk / experts x capacity factor)."""
    ffn_hidden_size: Optional[int] = None
    """Inner width of each expert (--moe-ffn-hidden-size); None means TransformerConfig.ffn_hidden_size."""
    shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared expert every token goes through (None: no shared expert)."""
    layer_freq: Union[int, str, List[int]] = 1
    """Which layers are MoE: every N-th, or a 0/1 list per layer (see parse_layer_freq)."""
    router_type: str = "token_choice"
    """token_choice (each token picks its top-k experts) or expert_choice (each expert picks its
    top-capacity tokens of the sequence; the diffusion modes only: over a causal sequence the choice
    would depend on future tokens)."""
    router_score_function: str = "softmax"
    """Router scores: softmax or sigmoid (DeepSeek-V3 style; the top-k are renormalised)."""
    router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (OLMoE, and Qwen without norm_topk_prob); by
    default the softmax is over the top-k logits, i.e. renormalised top-k probabilities."""
    router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routing probabilities (DeepSeek's routed scaling factor)."""
    router_load_balancing_type: str = "aux_loss"
    """aux_loss (Switch/GShard over each micro-batch), seq_aux_loss (the same per sequence, then
    averaged), or none."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0 turns it off)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss, mean of logsumexp(logits)^2 (0 turns it off)."""
    router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k selection only,
    moved by router_bias_update_rate x sign(mean load - load) after every step (sigmoid scores)."""
    router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    grouped_gemm: bool = False
    """All local experts as one grouped GEMM (torch grouped_mm, on CUDA in bf16); otherwise one GEMM
    per expert. Both give the same numbers up to float rounding."""
    token_dispatcher_type: str = "allgather"
    """How tokens reach the experts of other ranks: allgather (every rank of the expert group gathers
    all tokens and keeps those of its experts) or alltoall (each token is sent to its experts' rank)."""
    expert_capacity_factor: Optional[float] = None
    """Token choice: tokens an expert takes per micro-batch, as a multiple of the balanced share;
    the assignments with the lowest probabilities beyond it are dropped (None: dropless). Expert
    choice: the multiple of the balanced share each expert picks (None: 1)."""
    layer_flags: List[int] = field(default_factory=list)
    """Filled by `resolve(num_layers)`: 1 where layer i is MoE."""

    def resolve(self, num_layers: int) -> "MoEConfig":
        self.layer_flags = parse_layer_freq(self.layer_freq, num_layers)
        return self

    def is_moe_layer(self, layer_number: int) -> bool:
        return bool(self.layer_flags[layer_number]) if self.layer_flags else True

    def expert_capacity(self, num_tokens: int) -> int:
        """Assignments one expert takes out of `num_tokens` tokens (capacity-limited routing)."""
        factor = 1.0 if self.expert_capacity_factor is None else self.expert_capacity_factor
        return min(num_tokens, max(1, math.ceil(num_tokens * self.router_topk / self.num_experts * factor)))

    def validate(self, ffn_hidden_size: int) -> "MoEConfig":
        owner = "MoEConfig"
        for name in ("num_experts", "router_topk"):
            if getattr(self, name) is None or getattr(self, name) < 1:
                raise ValueError(f"{owner}.{name}={getattr(self, name)!r} must be a positive integer")
        if self.router_topk > self.num_experts:
            raise ValueError(f"{owner}.router_topk={self.router_topk} exceeds num_experts={self.num_experts}")
        for name, choices in (("router_type", ROUTER_TYPES), ("router_score_function", SCORE_FUNCTIONS),
                              ("router_load_balancing_type", LOAD_BALANCING_TYPES),
                              ("token_dispatcher_type", DISPATCHER_TYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{owner}.{name}={getattr(self, name)!r} is not one of {list(choices)}")
        for name in ("ffn_hidden_size", "shared_expert_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a positive integer")
        for name in ("aux_loss_coeff", "z_loss_coeff", "router_bias_update_rate"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number >= 0")
        if self.expert_capacity_factor is not None and not 0.0 < self.expert_capacity_factor < float("inf"):
            raise ValueError(f"{owner}.expert_capacity_factor={self.expert_capacity_factor} must be > 0 "
                             "(or unset: dropless)")
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            raise ValueError(f"{owner}.router_enable_expert_bias needs router_score_function='sigmoid' "
                             "(--moe-router-score-function sigmoid)")
        if self.router_type == "expert_choice" and (self.router_enable_expert_bias or self.aux_loss_coeff > 0):
            raise ValueError(f"{owner}.router_type='expert_choice' balances by construction: drop the aux loss "
                             "coefficient and the expert bias")
        if self.router_type == "expert_choice" and (self.router_score_function != "softmax" or
                                                   self.router_topk_scaling_factor is not None):
            raise ValueError(f"{owner}.router_type='expert_choice' weights tokens by their softmax scores: drop "
                             "the sigmoid score function and the top-k scaling factor (token-choice options)")
        if self.expert_ffn_size(ffn_hidden_size) < 1:
            raise ValueError(f"{owner}.ffn_hidden_size must be positive")
        return self

    def check_layout(self, ffn_hidden_size: int, tp_size: int, ep_size: int, etp_size: int,
                     sequence_parallel: bool) -> None:
        """What the process layout needs of the experts: `ep_size` ranks split the experts evenly,
        `etp_size` ranks each expert's FFN; tensor parallelism routes each rank's sequence slice (so
        it needs sequence parallelism). Checked on the flags (moe_args.py) and again on the process
        groups an MoE layer is built with."""
        if self.num_experts % ep_size:
            raise ValueError(f"--expert-model-parallel-size {ep_size} does not divide the {self.num_experts} experts; "
                             "choose a divisor of --num-experts")
        if self.expert_ffn_size(ffn_hidden_size) % etp_size:
            raise ValueError(f"--expert-tensor-parallel-size {etp_size} does not divide the expert ffn size "
                             f"{self.expert_ffn_size(ffn_hidden_size)}")
        if tp_size > 1 and not sequence_parallel:
            raise ValueError("MoE layers with tensor parallelism need sequence parallelism (each tensor-parallel "
                             "rank routes its own slice of the tokens); add --sequence-parallel")

    def expert_ffn_size(self, dense_ffn_hidden_size: int) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else dense_ffn_hidden_size

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)
