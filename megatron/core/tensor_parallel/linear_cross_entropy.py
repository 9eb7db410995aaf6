"""Output layer and cross-entropy over chunks of tokens: the full logits never exist.

`linear_cross_entropy(hidden [n, h], weight [V/tp, h], targets [n], loss_weights [n])`
returns the per-token losses and their weighted sum, equal to projecting all n tokens onto
the (vocab-parallel) output layer and taking an fp32 cross-entropy, but working on `chunk_size`
tokens at a time: per chunk, logits in the compute dtype, fp32 log-softmax (max and sum of
exponentials all-reduced over tp, as in cross_entropy.py), and right away the gradient of
the weighted sum with respect to the logits, folded into `grad_hidden` and `grad_weight`.
Peak memory is one chunk's logits instead of n x V/tp of fp32 logits and their copies.

Doing the backward's matmuls inside the forward is valid because the gradient of the sum is
`loss_weights` times the softmax minus the one-hot, and the only unknown, the incoming
gradient of the sum, is a scalar applied at backward time. Gradients that arrive through the
per-token losses instead (a caller weighting them itself) are supported too: that rarer path
recomputes each chunk's logits from the saved log-sum-exp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.fusions import fused_cross_entropy
from megatron.core.tensor_parallel.fp32_weight_grad import matmul_into
from megatron.core.tensor_parallel.tied_gradient import TiedGradient
from megatron.core.tensor_parallel.utils import all_reduce_in_place, group_rank, group_size


@dataclass(frozen=True)
class _Layout:
    """What a chunk needs to know about this rank's vocabulary slice and the numerics."""

    group: Optional[dist.ProcessGroup]
    vocab_start: int
    """Global id of this rank's first row of `weight`."""
    valid_rows: int
    """Rows of this rank's slice below the unpadded vocabulary; the rest are never predicted."""
    compute_dtype: torch.dtype
    chunk_size: int
    compiled: bool = False
    """Each chunk's softmax, loss and logits gradient fused: on one rank one kernel (Triton's, else
    torch.compile's); over tensor-parallel ranks Triton's two kernels with one all-gather between
    (where Triton does not run there, the eager passes)."""
    triton_kernel: bool = True
    """With `compiled`: the hand-written Triton kernels where they can run (False: torch.compile's kernel
    on one rank, the eager passes over tensor-parallel ranks; DLMConfig.loss_kernel)."""


def _chunks(count: int, chunk_size: int):
    """Even [start, end) ranges of at most chunk_size: no tiny last chunk (a slow, skinny GEMM)."""
    pieces = max(1, -(-count // chunk_size))
    step = max(1, -(-count // pieces))
    return [(start, min(start + step, count)) for start in range(0, count, step)]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """fp32 logits of a chunk of tokens on this rank's slice, -inf at the vocabulary padding."""
    logits = (hidden @ weight.t()).float()
    if layout.valid_rows < weight.shape[0]:
        logits[:, layout.valid_rows:] = float("-inf")
    return logits


def _local_targets(targets: torch.Tensor, local_rows: int, layout: _Layout):
    """(target index into this rank's slice, True where another rank owns the target)."""
    foreign = (targets < layout.vocab_start) | (targets >= layout.vocab_start + local_rows)
    return (targets - layout.vocab_start).masked_fill(foreign, 0), foreign


def _chunk_softmax(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, layout: _Layout):
    """fp32 (exp(logits - max), sum_exp, target_logit - max, max, local target, foreign mask) of a chunk."""
    logits = _chunk_logits(hidden, weight, layout)
    logits_max = all_reduce_in_place(logits.amax(dim=-1), dist.ReduceOp.MAX, layout.group)
    logits.sub_(logits_max.unsqueeze(-1))
    local_target, foreign = _local_targets(targets, weight.shape[0], layout)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
    exp_logits = logits.exp_()
    # One all-reduce for both [c] sums instead of two.
    sums = all_reduce_in_place(torch.stack([target_logit, exp_logits.sum(dim=-1)]), dist.ReduceOp.SUM, layout.group)
    return exp_logits, sums[1], sums[0], logits_max, local_target, foreign


def _logits_gradient(exp_logits, sum_exp, local_target, foreign, scale: torch.Tensor) -> torch.Tensor:
    """(softmax - one-hot) * scale[:, None], in place of exp_logits; only the owning rank has the one-hot."""
    grad = exp_logits.div_(sum_exp.unsqueeze(-1))
    grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~foreign).unsqueeze(-1).to(grad.dtype))
    return grad.mul_(scale.unsqueeze(-1))


def _softmax_loss_gradient(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, valid_rows: int):
    """One rank's whole vocabulary: (losses, log-sum-exp, gradient of sum(scale * losses) w.r.t. the
    logits, in the logits' dtype). Written as plain tensor math for torch.compile, which turns it
    into a few passes over the low-precision logits instead of a dozen over fp32 copies."""
    dtype = logits.dtype
    columns = torch.arange(logits.shape[-1], device=logits.device)
    logits = logits.float().masked_fill(columns >= valid_rows, float("-inf"))
    logits_max = logits.amax(dim=-1, keepdim=True)
    shifted = logits - logits_max
    sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
    log_sum = sum_exp.log()
    losses = (log_sum - shifted.gather(-1, targets.unsqueeze(-1))).squeeze(-1)
    one_hot = (columns == targets.unsqueeze(-1)).float()
    grad = (shifted.exp() / sum_exp - one_hot) * scale.unsqueeze(-1)
    return losses, (log_sum + logits_max).squeeze(-1), grad.to(dtype)


@functools.cache
def compiled_softmax_loss_gradient():
    """Compiled once per process, with dynamic shapes: the number of selected tokens changes every batch."""
    return torch.compile(_softmax_loss_gradient, dynamic=True)


def _fuses(layout: _Layout, chunk: torch.Tensor) -> bool:
    """Whether this chunk's loss runs fused (`_Layout.compiled`): always on one rank; over tensor-parallel
    ranks where Triton's kernels run on it."""
    if not layout.compiled:
        return False
    return group_size(layout.group) == 1 or (layout.triton_kernel and fused_cross_entropy.available(chunk))


def _fused_softmax_loss_gradient(logits, targets, scale, layout: _Layout):
    """_softmax_loss_gradient fused: on one rank Triton's kernel (two passes over the logits, the gradient
    written over them) where it can run, else torch.compile's; over tensor-parallel ranks Triton's pair."""
    if group_size(layout.group) > 1:
        return _vocab_parallel_fused(logits, targets, scale, layout)
    if layout.triton_kernel and fused_cross_entropy.available(logits):
        return fused_cross_entropy.softmax_loss_gradient_(logits, targets, scale, layout.valid_rows)
    return compiled_softmax_loss_gradient()(logits, targets, scale, layout.valid_rows)


def _vocab_parallel_fused(logits, targets, scale, layout: _Layout):
    """The fused loss over this rank's vocabulary slice: each rank's row statistics (log-sum-exp over
    its columns, the target's logit where it owns it), one all-gather of them, the global log-sum-exp
    and loss, then the gradient written over the logits. (losses, log-sum-exp, gradient) as on one rank."""
    local_target, foreign = _local_targets(targets, logits.shape[1], layout)
    owned = local_target.masked_fill(foreign, -1)
    statistics = torch.stack(fused_cross_entropy.row_statistics(logits, owned, layout.valid_rows))
    ranks = [torch.empty_like(statistics) for _ in range(group_size(layout.group))]
    dist.all_gather(ranks, statistics, group=layout.group)
    ranks = torch.stack(ranks)  # [tp, 2, c]: log-sum-exp and target logit of each rank
    log_sum_exp = torch.logsumexp(ranks[:, 0], dim=0)
    losses = log_sum_exp - ranks[:, 1].sum(dim=0)
    return losses, log_sum_exp, fused_cross_entropy.logits_gradient_(logits, owned, log_sum_exp, scale,
                                                                        layout.valid_rows)


def _accumulate(grad_logits, hidden, weight, grad_hidden, grad_weight, start: int, end: int,
                add_hidden: bool, add_weight: bool) -> None:
    """The chunk's contribution written to (or, with add_*, added to) grad_hidden[start:end] and
    grad_weight (fp32); the matmuls run in the compute dtype."""
    grad_logits = grad_logits.to(weight.dtype)
    matmul_into(grad_hidden[start:end], grad_logits, weight, add_hidden)
    matmul_into(grad_weight, grad_logits.t(), hidden, add_weight)


def _compute_weight(weight: torch.Tensor, weight_low: Optional[torch.Tensor], layout: _Layout) -> torch.Tensor:
    """The weight in the compute dtype: its working copy where it has one of that dtype, else a cast."""
    return weight_low if weight_low is not None and weight_low.dtype == layout.compute_dtype \
        else weight.to(layout.compute_dtype)


def _forward_chunks(hidden, weight, targets, loss_weights, layout: _Layout, needs_grad: bool, weight_low=None):
    """Per-token losses, their log-sum-exp, and (grad_hidden, grad_weight) of sum(loss_weights * losses)."""
    compute_weight = _compute_weight(weight, weight_low, layout)
    count = hidden.shape[0]
    losses = torch.empty(count, dtype=torch.float32, device=hidden.device)
    log_sum_exp = torch.empty_like(losses)
    grad_hidden, grad_weight = _empty_gradients(hidden, weight) if needs_grad else (None, None)
    chunks = _chunks(count, layout.chunk_size)
    for index, (start, end) in enumerate(chunks):
        chunk = hidden[start:end].to(layout.compute_dtype)
        if needs_grad and _fuses(layout, chunk):
            losses[start:end], log_sum_exp[start:end], grad_logits = _fused_softmax_loss_gradient(
                chunk @ compute_weight.t(), targets[start:end], loss_weights[start:end], layout)
            _accumulate(grad_logits, chunk, compute_weight, grad_hidden, grad_weight, start, end,
                        add_hidden=False, add_weight=index > 0)
            continue
        exp_logits, sum_exp, target_logit, logits_max, local_target, foreign = _chunk_softmax(
            chunk, compute_weight, targets[start:end], layout)
        losses[start:end] = torch.log(sum_exp) - target_logit
        log_sum_exp[start:end] = torch.log(sum_exp) + logits_max
        if needs_grad:
            grad_logits = _logits_gradient(exp_logits, sum_exp, local_target, foreign, loss_weights[start:end])
            _accumulate(grad_logits, chunk, compute_weight, grad_hidden, grad_weight, start, end,
                        add_hidden=False, add_weight=index > 0)
        del exp_logits
    if needs_grad and not chunks:  # no token selected: the gradients are zero
        grad_hidden.zero_(), grad_weight.zero_()
    return losses, log_sum_exp, (grad_hidden, grad_weight)


def _empty_gradients(hidden: torch.Tensor, weight: torch.Tensor):
    """fp32 buffers for (grad_hidden, grad_weight), filled by the chunks (each writes its rows of
    grad_hidden; the first writes grad_weight, the others add to it)."""
    return (torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device),
            torch.empty(weight.shape, dtype=torch.float32, device=weight.device))


def _scale_(grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_loss_sum: torch.Tensor) -> None:
    """The gradients made in forward times the loss sum's incoming gradient (fp16's loss scale, a
    pipeline schedule's or a caller's factor). In the training loop's bf16 and fp32 backward of the
    loss sum itself that factor is exactly 1, and the scaling of the fp32 [V, h] weight gradient (a
    read and a write: 2.5 GB, ~0.9 ms at Qwen3-1.7B) is skipped on the device, without a host read
    (`fused_cross_entropy.scale_unless_one_`)."""
    fused_cross_entropy.scale_unless_one_(grad_hidden, grad_loss_sum)
    fused_cross_entropy.scale_unless_one_(grad_weight, grad_loss_sum)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_weights, layout: _Layout, needs_grad: bool, weight_low=None,
                tied=None):
        ctx.set_materialize_grads(False)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes here are chosen explicitly
            losses, log_sum_exp, grads = _forward_chunks(hidden, weight, targets, loss_weights, layout, needs_grad,
                                                         weight_low)
        ctx.save_for_backward(hidden, weight, targets, log_sum_exp, weight_low)
        ctx.layout, ctx.weighted_grads, ctx.backward_done, ctx.tied = layout, grads, False, tied
        return losses, (losses * loss_weights).sum()

    @staticmethod
    def backward(ctx, grad_losses, grad_loss_sum):
        if ctx.backward_done:
            # The gradients made in forward are scaled in place: a second backward would see them twice.
            raise RuntimeError("linear_cross_entropy does not support a second backward (retain_graph)")
        ctx.backward_done = True
        hidden, weight, targets, log_sum_exp, weight_low = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.weighted_grads
        ctx.weighted_grads = None
        if grad_loss_sum is None:
            grad_hidden = grad_weight = None
        elif grad_hidden is not None:
            _scale_(grad_hidden, grad_weight, grad_loss_sum)
        if grad_losses is not None:
            with torch.autocast(hidden.device.type, enabled=False):
                grad_hidden, grad_weight = _per_token_backward(hidden, weight, targets, log_sum_exp, grad_losses,
                                                               ctx.layout, grad_hidden, grad_weight, weight_low)
        if grad_hidden is None:
            return None, None, None, None, None, None, None, None
        grad_weight = grad_weight.to(weight.dtype)
        if ctx.tied is not None and ctx.tied.armed:  # the embedding's backward adds its rows and returns it
            ctx.tied.grad, grad_weight = grad_weight, None
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None


def _per_token_backward(hidden, weight, targets, log_sum_exp, grad_losses, layout: _Layout,
                        grad_hidden, grad_weight, weight_low=None):
    """Gradients of sum(grad_losses * losses): each chunk's softmax is rebuilt from its saved
    log-sum-exp (no collective needed) and added to the gradients made in forward, if any."""
    fresh = grad_hidden is None
    if fresh:
        grad_hidden, grad_weight = _empty_gradients(hidden, weight)
    compute_weight = _compute_weight(weight, weight_low, layout)
    chunks = _chunks(hidden.shape[0], layout.chunk_size)
    if fresh and not chunks:
        grad_hidden.zero_(), grad_weight.zero_()
    for index, (start, end) in enumerate(chunks):
        chunk = hidden[start:end].to(layout.compute_dtype)
        logits = _chunk_logits(chunk, compute_weight, layout)
        softmax = logits.sub_(log_sum_exp[start:end].unsqueeze(-1)).exp_()
        local_target, foreign = _local_targets(targets[start:end], weight.shape[0], layout)
        ones = torch.ones_like(log_sum_exp[start:end])
        grad_logits = _logits_gradient(softmax, ones, local_target, foreign, grad_losses[start:end].float())
        _accumulate(grad_logits, chunk, compute_weight, grad_hidden, grad_weight, start, end,
                    add_hidden=not fresh, add_weight=not fresh or index > 0)
    return grad_hidden, grad_weight


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         loss_weights: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None,
                         unpadded_vocab_size: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None,
                         chunk_size: int = 4096, compiled: bool = False,
                         weight_low: Optional[torch.Tensor] = None, triton_kernel: bool = True,
                         tied: Optional[TiedGradient] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token fp32 losses [n], sum(losses * loss_weights)) of `hidden @ weight.T` against `targets`.

    `hidden` [n, h] must be the same on every tp rank (gather sequence-parallel activations
    first; its gradient is this rank's partial sum, to be all-reduced or reduce-scattered by
    the caller's mapping, as for a column-parallel linear). `weight` [V/tp, h] is this rank's
    slice of the (padded) vocabulary; ids >= `unpadded_vocab_size` are never predicted.
    `targets` are global ids, already checked to lie in the vocabulary. `loss_weights` [n] are
    constants (no gradient flows to them). Matmuls run in `compute_dtype` (default: the weight's),
    the softmax in fp32. `compiled`: each chunk's softmax and logits gradient run fused (see
    `_Layout.compiled`; `triton_kernel`: through the Triton kernels where they run, see
    `_Layout.triton_kernel`). `weight_low`: the weight's working copy in `compute_dtype`
    (`--cache-low-precision-weights`), read instead of casting `weight`; the gradient still reaches
    `weight`. `tied`: where `weight` is also the word embedding looked up in this forward, the weight's
    gradient is handed to the embedding's backward to complete (tied_gradient.py) instead of being
    returned. Not for a second backward of the same graph.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or loss_weights.shape != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [n, h] with targets {tuple(targets.shape)} and "
                         f"loss_weights {tuple(loss_weights.shape)} of shape [n]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    local = weight.shape[0]
    vocab_start = group_rank(tp_group) * local
    valid_rows = local if unpadded_vocab_size is None else max(0, min(local, unpadded_vocab_size - vocab_start))
    layout = _Layout(tp_group, vocab_start, valid_rows, compute_dtype or weight.dtype, chunk_size, compiled,
                     triton_kernel)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, loss_weights.detach().float(), layout, needs_grad,
                                     weight_low, tied)
