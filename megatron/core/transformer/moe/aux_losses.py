"""How the routers' balancing losses reach the gradients.

The training loop backpropagates each micro-batch's *sum* of weighted token losses and divides
the gradients once per step by the global batch's normalizer N (loss_normalization.py). A
balancing loss is a mean over a micro-batch, so it enters the objective as

    loss = sum_tokens(weighted loss) / N + sum_mb (n_mb / N) * balancing_loss_mb,

each micro-batch's balancing loss weighted by its share n_mb / N of the normalizer (the shares
sum to 1; with equal micro-batches it is the plain mean). Its gradient therefore enters the
backward multiplied by n_mb, which the loop knows when the micro-batch's forward runs (every
pipeline stage derives the same normalizer from the batch), and which the model hands to its
routers as `aux_loss_scale` (GPTModel.forward; 1 when not given: a forward that returns a mean
loss adds the balancing losses with weight 1).

`AttachAuxLoss` carries the loss on the routing probabilities, which every MoE output depends
on, so no stage has to return it: forward is the identity on the probabilities, backward adds
the scale to the loss's gradient. (Megatron-LM attaches its auxiliary losses the same way.)
"""

from __future__ import annotations

from typing import Optional

import torch


class AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs: torch.Tensor, aux_loss: torch.Tensor, scale: Optional[torch.Tensor]):
        ctx.scale = 1.0 if scale is None else scale
        ctx.loss_dtype, ctx.loss_device = aux_loss.dtype, aux_loss.device
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=ctx.loss_device, dtype=ctx.loss_dtype)
        aux_grad = torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device) * scale
        return grad, aux_grad, None
