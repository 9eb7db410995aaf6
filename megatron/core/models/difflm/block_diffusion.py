"""Block diffusion (BD3-LM, --difflm-block-diffusion): the vectorised training input.

A sample of L tokens is split into blocks of B. Each block is denoised conditioned on the clean
blocks before it, with its own noise level t (diffusion.sample_block_t). One forward computes
every block's conditional: the model reads [x_t ; x_0] (2L tokens, the clean half at the same
positions as the noisy one) under one mask (attention_mask.block_diffusion_allowed): noisy
block b sees itself and clean blocks < b, clean block b sees clean blocks <= b. The loss is on
the noisy half only, so the weights of the clean half are 0.

The corruption is unchanged (diffusion.corrupt keyed by sample and position, t per block), so
every layout derives the same masks; the doubling happens inside the model (GPTModel._forward),
and callers hand it the usual [b, L] noisy ids, clean labels and weights. The sampler that
matches this training is megatron/core/inference/generation.py's block-diffusion path: committed
clean blocks go into an exact KV cache, as the clean half here is computed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.models.difflm.batch import positions_from_documents

__all__ = ["noisy_length", "model_inputs"]


def noisy_length(input_ids: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> int:
    """L: the length of the noisy half (of the [b, L] ids or labels handed to the model)."""
    reference = input_ids if input_ids is not None else labels
    if reference is None:
        raise ValueError("block diffusion needs the [b, L] input ids or labels on every pipeline stage, to "
                         "build its [x_t ; x_0] mask")
    return reference.shape[1]


def _doubled(tensor: Optional[torch.Tensor], second: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    return torch.cat([tensor, tensor if second is None else second], dim=1)


def model_inputs(input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                 labels: Optional[torch.Tensor], loss_weights: Optional[torch.Tensor],
                 document_ids: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """[b, L] noisy ids, positions, clean labels, weights, documents -> their [b, 2L] forms over
    [x_t ; x_0]: the clean half is the labels (the DLM's labels are the clean ids), at the same
    positions and documents as the noisy half, with no loss weight."""
    if input_ids is not None and labels is None:
        raise ValueError("block diffusion needs labels (the clean ids x_0) to build its [x_t ; x_0] input")
    if position_ids is None:
        reference = input_ids if input_ids is not None else labels
        batch, length = reference.shape
        position_ids = (positions_from_documents(document_ids) if document_ids is not None
                        else torch.arange(length, device=reference.device).expand(batch, length))
    if loss_weights is None and labels is not None:  # every noisy position, none of the clean half
        loss_weights = torch.ones_like(labels, dtype=torch.float32)
    weights = None if loss_weights is None else _doubled(loss_weights, torch.zeros_like(loss_weights))
    return (_doubled(input_ids, labels), _doubled(position_ids), _doubled(labels), weights, _doubled(document_ids))
