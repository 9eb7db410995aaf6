"""One gradient for a tied word embedding and output layer, summed without a dense [V, h] pass.

With tied weights the output layer's gradient (the chunked loss makes it in fp32, [V, h]) and the
embedding's meet in autograd: the embedding's backward writes a zeroed [V, h] fp32 tensor with the
rows of the looked-up tokens, then autograd reads both tensors and writes their sum. At Qwen3-1.7B's
vocabulary that is about 5 GB moved a micro-batch (1.24 GB of zeros, then two reads and a write) for
a few thousand touched rows. Here the loss hands its gradient to a `TiedGradient` instead of
returning it, and the embedding's backward adds the tokens' rows into that tensor in place and
returns it: the weight receives one gradient, the same sum, without the dense passes.

The embedding's backward always runs after the loss's (the loss reads the decoder's output, which
reads the embedding's), and the loss hands its gradient over only when the embedding armed the
`TiedGradient` (it looked its ids up in the same weight with autograd on); otherwise, or where the
loss returns its gradient as usual (the full-logits path), autograd adds the two as before.
The rows are added with `index_add_`: on CUDA with atomics (0.17 ms at 8192 tokens x 2048 on an
H200, against 1.5 ms for the dense passes and 1.5 ms for the sorted `index_put_(accumulate=True)`),
so repeated ids make the sum's last bits vary from run to run, as in any atomics-based kernel;
under `--deterministic-mode` (torch.use_deterministic_algorithms) torch runs it as the sorted,
deterministic sum instead. Either way the rounding differs from the dense path's (the rows are added
to the loss's values one by one, not summed first), within fp32 rounding.

An untied embedding meets the same dense passes across micro-batches: each backward writes a zeroed
[V, h] fp32 gradient with its tokens' rows, and autograd adds it to `.grad` (at the `7b-shape`'s
151,936 x 4096: 2.5 GB zeroed, then 7.5 GB read and written, each micro-batch after the first). Where the
schedule lets the layers add their weight gradients into `.grad` in place
(`fp32_weight_grad.accumulating_into_grad`), the lookup's backward adds its rows into the existing `.grad` the same way
(`add_rows`) and autograd gets no gradient for the weight.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn



class TiedGradient:
    """Where the loss leaves the tied weight's gradient for the embedding's backward to complete."""

    __slots__ = ("grad", "armed")

    def __init__(self) -> None:
        self.grad: Optional[torch.Tensor] = None
        self.armed = False
        """Set by `embedding` when its backward will take the gradient: only then may the loss hand it over."""

    def take(self) -> Optional[torch.Tensor]:
        grad, self.grad = self.grad, None
        return grad


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.weight_shape, ctx.weight_dtype = tied, weight.shape, weight.dtype
        return nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad = ctx.tied.take()
        if grad is None:  # the loss made none (it did not need the weight's gradient): the plain one
            grad = grad_output.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        add_rows(grad, ids, grad_output)
        return None, grad, None


def add_rows(grad: torch.Tensor, ids: torch.Tensor, grad_output: torch.Tensor) -> None:
    """grad[ids[i]] += grad_output[i] for every looked-up token, in place (repeated ids summed)."""
    grad.index_add_(0, ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1]).to(grad.dtype))


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, grad_into: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.grad_into = grad_into
        return nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        add_rows(ctx.grad_into, ids, grad_output)
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, tied: Optional[TiedGradient] = None,
              grad_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.embedding(ids, weight)`; with `tied`, its backward completes the gradient the loss left there;
    untied, with `grad_into` (the weight's `.grad`, `GemmLayer.grad_into`), it adds its rows there."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return nn.functional.embedding(ids, weight)
    if tied is None:
        if grad_into is None:
            return nn.functional.embedding(ids, weight)
        return _EmbeddingIntoGrad.apply(ids, weight, grad_into)
    tied.armed = True
    return _TiedEmbedding.apply(ids, weight, tied)
