"""The mixture-of-experts layer in the MLP slot: router -> dispatch -> experts -> combine,
plus an optional shared expert every token goes through.

Input and output are the MLP slot's `[s, b, h]` (`[s/tp, b, h]` under sequence parallelism,
which MoE with tensor parallelism requires: each tp rank routes its own slice of the tokens).
The shared expert is a dense tensor-parallel MLP on the same input. Which ranks hold which
experts, and which groups the dispatch and the gradients use, come from the expert grid of
ParallelState (tp-ep-edp-pp folding); with no groups the layer is the single-process reference.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
from torch import nn

from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.router import TopKRouter, build_router
from megatron.core.transformer.moe.token_dispatcher import build_dispatcher
from megatron.core.transformer.transformer_config import TransformerConfig


class MoELayer(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0, pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        moe = config.moe
        pg = pg if pg is not None else ProcessGroups()
        self.layer_number = layer_number
        sequence_parallel = getattr(pg, "sequence_parallel", False)
        moe.check_layout(config.ffn_hidden_size, group_size(pg.tp), group_size(pg.ep), group_size(pg.expert_tp),
                         sequence_parallel)
        seq_group = sequence_group(pg, sequence_parallel)
        self.router = build_router(config, layer_number, seq_group,
                                   partial_over_tp=sequence_parallel and group_size(pg.tp) > 1)
        ep_size, etp_size = group_size(pg.ep), group_size(pg.expert_tp)
        self.experts = GroupedExperts(config, layer_number, ep_rank=group_rank(pg.ep), ep_size=ep_size,
                                      etp_rank=group_rank(pg.expert_tp), etp_size=etp_size,
                                      edp_rank=group_rank(pg.expert_dp))
        self.dispatcher = build_dispatcher(moe.token_dispatcher_type, pg.expert_tp_ep, ep_size, etp_size,
                                           moe.num_experts)
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            shared = config.replace(ffn_hidden_size=moe.shared_expert_intermediate_size, moe=None)
            self.shared_experts = MLP(shared, layer_number, pg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden_states.shape
        tokens = hidden_states.reshape(s * b, h)
        routing = self.router(tokens, (s, b))
        output = self.dispatcher(tokens, routing, self.experts).view(s, b, h)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output


def sequence_group(pg: ProcessGroups, sequence_parallel: bool):
    """The ranks holding other parts of the same sequences: tp under sequence parallelism, cp, or both."""
    tp_parallel = sequence_parallel and group_size(pg.tp) > 1
    cp_parallel = group_size(pg.cp) > 1
    if tp_parallel and cp_parallel:
        return pg.tp_cp
    return pg.tp if tp_parallel else (pg.cp if cp_parallel else None)


def build_mlp(config: TransformerConfig, layer_number: int, pg: Optional[ProcessGroups] = None) -> nn.Module:
    """The MLP slot of layer `layer_number`: an MoE layer where `config.moe` says so, else the dense MLP."""
    if config.moe is not None and config.moe.is_moe_layer(layer_number):
        return MoELayer(config, layer_number, pg)
    return MLP(config, layer_number, pg)


def routers(model: nn.Module) -> List[TopKRouter]:
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def set_aux_loss_scale(layers: Iterable[TopKRouter], scale) -> None:
    """The weight of the coming forward's balancing losses (aux_losses.py), for every router."""
    for router in layers:
        router.aux_loss_scale = scale
