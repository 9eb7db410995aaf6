"""Block diffusion (BD3-LM, --difflm-block-diffusion): the vectorised training input.

A sample of L tokens is split into blocks of B. Each block is denoised conditioned on the clean
blocks before it, with its own noise level t (diffusion.sample_block_t). One forward computes
every block's conditional: the model reads [x_t ; x_0] (2L tokens, the clean half at the same
positions as the noisy one) under one mask (attention_mask.block_diffusion_allowed): noisy
block b sees itself and clean blocks < b, clean block b sees clean blocks <= b. The loss is on
the noisy half only, so the weights of the clean half are 0.

With the joint AR + DLM objective (DLMConfig.ar_loss_weight, `ar_weights` here) the clean half is
token-causal and carries the next-token loss: its labels are the clean ids shifted left by one and
its weights the AR term's, so one forward scores both terms (an AR forward of L tokens rides on the
2L-token forward block diffusion runs anyway; a second forward would cost a causal pass of L tokens
more and, under pipelining, a second trip through the stages).

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

__all__ = ["noisy_length", "model_inputs", "next_tokens", "joint_weights", "clean_half_loss", "ar_loss_weights"]


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
                 document_ids: Optional[torch.Tensor],
                 ar_weights: Optional[torch.Tensor] = None) -> Tuple[Optional[torch.Tensor], ...]:
    """[b, L] noisy ids, positions, clean labels, weights, documents -> their [b, 2L] forms over
    [x_t ; x_0]: the clean half is the labels (the DLM's labels are the clean ids), at the same
    positions and documents as the noisy half, with no loss weight; or, given `ar_weights` [b, L]
    (the joint objective's), with the next clean token as label and those weights."""
    if input_ids is not None and labels is None:
        raise ValueError("block diffusion needs labels (the clean ids x_0) to build its [x_t ; x_0] input")
    if position_ids is None:
        reference = input_ids if input_ids is not None else labels
        batch, length = reference.shape
        position_ids = (positions_from_documents(document_ids) if document_ids is not None
                        else torch.arange(length, device=reference.device).expand(batch, length))
    if loss_weights is None and labels is not None:  # every noisy position, none of the clean half
        loss_weights = torch.ones_like(labels, dtype=torch.float32)
    if ar_weights is not None and loss_weights is not None:
        return (_doubled(input_ids, labels), _doubled(position_ids), _doubled(labels, next_tokens(labels)),
                _doubled(loss_weights, ar_weights.to(loss_weights.dtype)), _doubled(document_ids))
    weights = None if loss_weights is None else _doubled(loss_weights, torch.zeros_like(loss_weights))
    return (_doubled(input_ids, labels), _doubled(position_ids), _doubled(labels), weights, _doubled(document_ids))


def next_tokens(clean: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The next-token labels of [b, L] clean ids: position i's is token i + 1 (the last position's is
    a placeholder, the first id, which the AR weights leave without loss)."""
    return None if clean is None else torch.roll(clean, shifts=-1, dims=1)


def joint_weights(dlm, labels: torch.Tensor, given: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The next-token weights a joint AR + DLM model's clean half carries (DLMConfig.causal_clean_half):
    `given`, or by default the weight at every position but the last; None for plain block diffusion."""
    if not dlm.causal_clean_half:
        return None
    return given if given is not None else ar_loss_weights(dlm.ar_loss_weight, None, labels)


def clean_half_loss(per_token: torch.Tensor, weights: torch.Tensor, query: torch.Tensor, noisy_length: int,
                    normalizer: torch.Tensor) -> torch.Tensor:
    """The joint objective's next-token term of a [x_t ; x_0] forward: the weighted per-token losses at the
    clean positions (`query`: the global positions of this rank's tokens) over the normalizer, detached."""
    clean = torch.where(query >= noisy_length, weights, torch.zeros_like(weights))
    return (per_token.detach() * clean).sum() / normalizer


def ar_loss_weights(weight: float, loss_mask: Optional[torch.Tensor], reference: torch.Tensor) -> torch.Tensor:
    """[b, L] float32 weights of the joint objective's next-token term: `weight` where token i + 1 may
    carry a loss (`loss_mask`, label-aligned as the DLM's: padding, --eod-mask-loss, an SFT prompt
    have none), 0 at the last position, which has no next token in the row. As the vanilla mode's
    labels, a document's last token predicts the next document's first (Megatron's convention)."""
    mask = torch.ones_like(reference, dtype=torch.float32) if loss_mask is None else loss_mask.to(torch.float32)
    weights = torch.zeros_like(mask)
    weights[:, :-1] = weight * mask[:, 1:]
    return weights
