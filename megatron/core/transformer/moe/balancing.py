"""Once per training step: the routers' statistics summed over every rank, the aux-loss-free
expert-bias update, and the numbers the log prints.

During the step each router adds its micro-batches' token counts per expert and its balancing
losses' values (its rank's share) to buffers (router.py). `finish_router_step` sums them over
all ranks in one all-reduce of a `[layers, experts + 2]` table (a layer's row is filled by the
ranks of its pipeline stage, zeros elsewhere), so every rank sees the global counts of every
layer: the bias update is then the same on every rank and in every layout,

    expert_bias += bias_update_rate * sign(mean_e(count) - count_e)

(Megatron-LM's rule: under-loaded experts are favoured next step), and the buffers are reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.moe.moe_layer import routers
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class RouterStepStats:
    aux_loss: float
    """The load-balancing loss (coefficient included), mean per micro-batch, summed over layers."""
    z_loss: float
    """The router z-loss (coefficient included), the same way."""
    max_load: Dict[int, float]
    """Per MoE layer: the busiest expert's tokens over the mean (1.0 is perfect balance)."""
    min_load: Dict[int, float]
    """Per MoE layer: the idlest expert's tokens over the mean."""

    def scalars(self) -> Dict[str, float]:
        values = {"moe/aux-loss": self.aux_loss, "moe/z-loss": self.z_loss}
        for layer in self.max_load:
            values[f"moe/layer-{layer}/max-load"] = self.max_load[layer]
            values[f"moe/layer-{layer}/min-load"] = self.min_load[layer]
        return values

    def summary(self) -> str:
        """The console fields: the losses and the worst balance over layers."""
        line = f"moe aux loss: {self.aux_loss:.6E} | moe z loss: {self.z_loss:.6E}"
        if self.max_load:
            line += f" | expert load max/min: {max(self.max_load.values()):.3f}/{min(self.min_load.values()):.3f}"
        return line


def finish_router_step(model: nn.Module, config: Optional[TransformerConfig], microbatches_per_step: int,
                       update_bias: bool = True) -> Optional[RouterStepStats]:
    """Reduce, update the expert biases (`update_bias`), reset; None for a dense model.
    `microbatches_per_step`: over all data-parallel replicas. A collective over the default group:
    every rank calls it once per step (a pipeline stage without MoE layers too)."""
    if config is None or config.moe is None:
        return None
    local, num_experts = routers(model), config.moe.num_experts
    device = next(model.parameters()).device
    table = torch.zeros(config.num_layers, num_experts + 2, dtype=torch.float64, device=device)
    for router in local:
        table[router.layer_number, :num_experts] = router.tokens_per_expert
        table[router.layer_number, num_experts:] = router.loss_sums
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    for router in local:
        counts = table[router.layer_number, :num_experts]
        if update_bias and router.expert_bias is not None and counts.sum() > 0:
            step = router.moe.router_bias_update_rate * torch.sign(counts.mean() - counts)
            router.expert_bias += step.to(router.expert_bias.dtype)
        router.tokens_per_expert.zero_()
        router.loss_sums.zero_()
    return _stats(table, num_experts, microbatches_per_step)


def _stats(table: torch.Tensor, num_experts: int, microbatches: int) -> RouterStepStats:
    counts = table[:, :num_experts]
    used = counts.sum(1) > 0
    losses = table[:, num_experts:].sum(0) / max(microbatches, 1)
    mean = counts.mean(1, keepdim=True).clamp(min=1e-12)
    load = (counts / mean).cpu()
    layers = used.nonzero().flatten().tolist()
    return RouterStepStats(aux_loss=float(losses[0]), z_loss=float(losses[1]),
                           max_load={layer: float(load[layer].max()) for layer in layers},
                           min_load={layer: float(load[layer].min()) for layer in layers})
