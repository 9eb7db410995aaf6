"""Routers: which experts each token goes to, with what weight, and the balancing losses.

A router maps the tokens of a micro-batch, `[T, h]` (T = s x b in sequence-first order, this
rank's share under sequence or context parallelism), to a `Routing`: where each token goes
(`routing_map [T, E]`, bool) and with what weight (fp32; the weight of expert e's output in
token t's result).

The gate runs in fp32 whatever the compute dtype. Two kinds:
- `TopKRouter` (token choice): each token takes its top-k experts (softmax or sigmoid scores, an
  optional aux-loss-free expert bias for the selection, an optional capacity with token dropping).
- `ExpertChoiceRouter`: each expert takes its top-capacity tokens of every sequence. Balanced by
  construction, no auxiliary loss. Only for the diffusion modes: in an autoregressive model the
  choice over the sequence would depend on tokens after the one being predicted.

Balancing losses (`aux_loss`, `seq_aux_loss`, the z-loss) are computed over the whole
micro-batch, however its sequence is split over ranks (`seq_group`: the tensor-parallel ranks
under sequence parallelism and the context-parallel ranks): each rank computes its share, and
the shares sum to the single-process value. They reach the gradients through `AttachAuxLoss`
(aux_losses.py) with the scale the training loop gives the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.inference.kv_cache import compiler_disabled
from megatron.core.tensor_parallel.layers import init_master_weight, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import all_gather_dim
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.init import parameter_seed
from megatron.core.transformer.moe.aux_losses import AttachAuxLoss
from megatron.core.transformer.moe.config import MoEConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig



@dataclass
class Routing:
    """Dense form: `routing_map [T, E]` and `probs [T, E]` (0 where not routed). Dropless token
    choice gives `top_indices` / `top_probs [T, k]` instead of `probs`: every token has exactly k
    assignments, so the dispatch needs no host sync and the combine is a sum over k (no atomics)."""

    routing_map: torch.Tensor
    probs: Optional[torch.Tensor] = None
    top_indices: Optional[torch.Tensor] = None
    top_probs: Optional[torch.Tensor] = None

    def dense_probs(self) -> torch.Tensor:
        if self.probs is not None:
            return self.probs
        zeros = torch.zeros(self.routing_map.shape, dtype=self.top_probs.dtype, device=self.top_probs.device)
        return zeros.scatter(-1, self.top_indices, self.top_probs)

    def weighted(self, scale_with) -> "Routing":
        """The same routing with its weights passed through `scale_with` (an autograd attachment)."""
        if self.top_probs is not None:
            return Routing(self.routing_map, top_indices=self.top_indices, top_probs=scale_with(self.top_probs))
        return Routing(self.routing_map, probs=scale_with(self.probs))


class TopKRouter(MegatronModule):
    """Token choice: a linear gate `[E, h]`, scores, top-k, balancing losses."""

    def __init__(self, config: TransformerConfig, layer_number: int = 0, seq_group=None,
                 partial_over_tp: bool = False) -> None:
        super().__init__(config)
        moe: MoEConfig = config.moe
        self.moe, self.layer_number, self.seq_group = moe, layer_number, seq_group
        self.weight = nn.Parameter(init_master_weight((moe.num_experts, config.hidden_size), config.init_method_std,
                                                      parameter_seed(layer_number, "router"), config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, None)
        # Under sequence parallelism each tp rank routes other tokens: the gradient is a partial sum.
        self.weight.allreduce_over_tp = partial_over_tp
        if moe.router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Per-step statistics (token counts for the expert-bias update and the log; the losses'
        # values), summed over the step's micro-batches and read by balancing.py.
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("loss_sums", torch.zeros(2, dtype=torch.float64), persistent=False)
        self.aux_loss_scale: Optional[torch.Tensor] = None
        """Set by GPTModel before each forward: the weight of this micro-batch's balancing losses
        (the loop sums token losses and divides once: the micro-batch's normalizer)."""

    # ------------------------------------------------------------------ routing
    def gate(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, enabled=False):
            return nn.functional.linear(tokens.float(), self.weight.float())

    def forward(self, tokens: torch.Tensor, shape: Tuple[int, int]) -> Routing:
        """`tokens [T, h]` with `shape = (s, b)`, T = s * b."""
        logits = self.gate(tokens)
        routing = self.route(logits, shape)
        losses = self.balancing_losses(logits, routing.routing_map, shape)
        if losses is not None and torch.is_grad_enabled():
            total = losses.sum()
            routing = routing.weighted(lambda probs: AttachAuxLoss.apply(probs, total, self.aux_loss_scale))
        self._record(routing.routing_map, losses)
        return routing

    def route(self, logits: torch.Tensor, shape: Tuple[int, int]) -> Routing:
        moe = self.moe
        if moe.router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            selection = scores if self.expert_bias is None else scores + self.expert_bias
            top_indices = selection.topk(moe.router_topk, dim=-1).indices
            top = scores.gather(-1, top_indices)
            if moe.router_topk > 1:
                top = top / (top.sum(-1, keepdim=True) + 1e-20)
        elif moe.router_pre_softmax:
            top, top_indices = torch.softmax(logits, dim=-1).topk(moe.router_topk, dim=-1)
        else:
            top_logits, top_indices = logits.topk(moe.router_topk, dim=-1)
            top = torch.softmax(top_logits, dim=-1)
        if moe.router_topk_scaling_factor is not None:
            top = top * moe.router_topk_scaling_factor
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top_indices, True)
        routing = Routing(routing_map, top_indices=top_indices, top_probs=top)
        return self._drop_over_capacity(routing) if moe.expert_capacity_factor is not None else routing

    def _drop_over_capacity(self, routing: Routing) -> Routing:
        """Each expert keeps its `capacity` highest-probability assignments of this rank's tokens."""
        probs, routing_map = routing.dense_probs(), routing.routing_map
        capacity = self.moe.expert_capacity(probs.shape[0])
        kept = probs.detach().masked_fill(~routing_map, -1.0).topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept, True) & routing_map
        return Routing(keep, probs=probs * keep)

    # ------------------------------------------------------------------ losses
    def _sequence_totals(self, local: torch.Tensor) -> torch.Tensor:
        """`local` summed over the ranks that hold other parts of the same sequences (no grad)."""
        if group_size(self.seq_group) > 1:
            local = local.clone()
            dist.all_reduce(local, group=self.seq_group)
        return local

    @compiler_disabled
    def balancing_losses(self, logits: torch.Tensor, routing_map: torch.Tensor,
                         shape: Tuple[int, int]) -> Optional[torch.Tensor]:
        """This rank's share of [load-balancing loss, z-loss] (None when both are off). Eager under
        torch.compile: inductor (torch 2.13) gets the gradients of the two losses together wrong
        inside a compiled MoE layer (tests/unit_tests/test_compilation.py catches it); [T, E]
        elementwise work, cheap."""
        moe = self.moe
        balance = moe.router_load_balancing_type != "none" and moe.aux_loss_coeff > 0
        if not balance and moe.z_loss_coeff == 0:
            return None
        s, b = shape
        ranks = group_size(self.seq_group)
        zero = logits.new_zeros(())
        aux = self._load_balancing_loss(logits, routing_map, s, b, ranks) if balance else zero
        z = zero
        if moe.z_loss_coeff > 0:
            z = moe.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / (s * b * ranks)
        return torch.stack([aux, z])

    def _load_balancing_loss(self, logits: torch.Tensor, routing_map: torch.Tensor, s: int, b: int,
                             ranks: int) -> torch.Tensor:
        """Switch/GShard: coeff * E * sum_e f_e * P_e, f_e the fraction of assignments to e and P_e
        its mean score, over the micro-batch (aux_loss) or per sequence, averaged (seq_aux_loss)."""
        moe, experts = self.moe, self.moe.num_experts
        if moe.router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = torch.softmax(logits, dim=-1)
        if moe.router_load_balancing_type == "seq_aux_loss":
            counts = self._sequence_totals(routing_map.view(s, b, experts).sum(0).to(scores.dtype))  # [b, E]
            tokens = s * ranks
            share = (scores.view(s, b, experts).sum(0) * counts).sum() / b
        else:
            counts = self._sequence_totals(routing_map.sum(0).to(scores.dtype))  # [E]
            tokens = s * b * ranks
            share = (scores.sum(0) * counts).sum()
        return share * (moe.aux_loss_coeff * experts / (moe.router_topk * tokens * tokens))

    @compiler_disabled
    def _record(self, routing_map: torch.Tensor, losses: Optional[torch.Tensor]) -> None:
        """Add this micro-batch to the step's statistics (training forwards only; a recompute in
        backward replays a forward already counted). Eager under torch.compile: it reads autograd's
        state and updates buffers in place."""
        if not (self.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
            return
        with torch.no_grad():
            self.tokens_per_expert += routing_map.sum(0).to(torch.float64)
            if losses is not None:
                self.loss_sums += losses.detach().to(torch.float64)


class ExpertChoiceRouter(TopKRouter):
    """Each expert takes, in every sequence, the `capacity` tokens with the highest softmax scores
    (capacity = sequence length x topk / experts x capacity factor): every expert processes the
    same number of tokens, so no balancing loss is needed. The choice looks at the whole sequence,
    gathered over the ranks that hold parts of it (scores only, E values per token)."""

    def route(self, logits: torch.Tensor, shape: Tuple[int, int]) -> Routing:
        s, b = shape
        experts = self.moe.num_experts
        scores = torch.softmax(logits, dim=-1).view(s, b, experts)
        whole = all_gather_dim(scores.detach(), 0, self.seq_group)  # [S, b, E]
        capacity = self.moe.expert_capacity(whole.shape[0])
        threshold = whole.topk(capacity, dim=0).values[-1]  # [b, E]: the capacity-th best score
        routing_map = scores.detach() >= threshold
        probs = scores * routing_map
        return Routing(routing_map.view(s * b, experts), probs=probs.view(s * b, experts))


def build_router(config: TransformerConfig, layer_number: int, seq_group=None,
                 partial_over_tp: bool = False) -> TopKRouter:
    cls = ExpertChoiceRouter if config.moe.router_type == "expert_choice" else TopKRouter
    return cls(config, layer_number, seq_group, partial_over_tp)
