"""Cross-entropy over logits whose vocabulary dim is split across tensor-parallel ranks.

Gathering `[s, b, V]` logits would cost V/tp times more traffic and memory than needed.
Instead each token's loss `log(sum_v exp(z_v)) - z_target` is assembled from small
`[s, b]` reductions: the global max (for stability), the target logit from the rank that
owns it, and the sum of exponentials. The backward is the softmax minus the one-hot of
the target, which each rank forms for its own vocabulary slice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import all_reduce_in_place, check_index_range, group_rank, group_size


def _shifted_logits(logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """(logits minus each token's global maximum, fp32; each target's index in this rank's slice, and
    whether another rank owns it; the target's shifted logit here, 0 where foreign): one max all-reduce."""
    local_vocab = logits.shape[-1]
    vocab_start = group_rank(group) * local_vocab
    logits_max = all_reduce_in_place(logits.amax(dim=-1).float(), dist.ReduceOp.MAX, group)
    # Subtracting an fp32 tensor promotes bf16/fp16 logits to fp32 in the same allocation.
    shifted = logits - logits_max.unsqueeze(-1)
    foreign = (target < vocab_start) | (target >= vocab_start + local_vocab)
    local_target = (target - vocab_start).masked_fill(foreign, 0)
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
    return shifted, local_target, foreign, target_logit


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocab-sharded logits; saves the local softmax for backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]):
        shifted, local_target, foreign, target_logit = _shifted_logits(logits, target, group)
        exp_logits = shifted.exp_()
        # One all-reduce for both sums instead of two: they are independent [..] tensors.
        sums = all_reduce_in_place(torch.stack([target_logit, exp_logits.sum(dim=-1)]), dist.ReduceOp.SUM, group)
        target_logit, sum_exp = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, foreign)
        ctx.logits_dtype = logits.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:
            # The saved softmax is turned into the gradient in place to avoid a logits-sized copy.
            raise RuntimeError("vocab_parallel_cross_entropy does not support a second backward (retain_graph)")
        ctx.backward_done = True
        softmax, local_target, foreign = ctx.saved_tensors
        grad = softmax
        # Only the owning rank subtracts the one-hot; elsewhere the added value is 0.
        owned = (~foreign).unsqueeze(-1).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp_group: Optional[dist.ProcessGroup], check_targets: bool = True) -> torch.Tensor:
    """Per-token fp32 loss `[...]` from local logits `[..., V/tp]` and global targets `[...]`.

    Equals `F.cross_entropy(full_logits, target, reduction="none")` without ever forming
    the full vocabulary. Targets must lie in `[0, V)`; padded vocabulary rows are ordinary
    logits (give them a large negative value upstream if they must never be predicted).
    `check_targets=False` skips the range check (a host sync) for targets the caller validated.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must agree "
                         "on every dim but the last (vocabulary)")
    # Checked before any collective; targets are the same on every tp rank, so all raise together.
    if check_targets:
        check_index_range(target, logits.shape[-1] * group_size(tp_group), "cross-entropy targets")
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)


class _VocabParallelConfidentEntropy(torch.autograd.Function):
    """Per-token entropy of the softmax of vocab-sharded logits, and whether the target is its argmax."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]):
        shifted, _, _, target_logit = _shifted_logits(logits, target, group)
        exp_logits = shifted.exp()
        # sum_v e^z'_v z'_v with the padding's -inf columns (e^z' = 0) adding nothing, not NaN
        weighted = torch.where(exp_logits > 0, exp_logits * shifted, torch.zeros_like(shifted)).sum(dim=-1)
        sums = all_reduce_in_place(torch.stack([target_logit, exp_logits.sum(dim=-1), weighted]),
                                   dist.ReduceOp.SUM, group)
        target_logit, sum_exp, weighted = sums[0], sums[1], sums[2]
        entropy = torch.log(sum_exp) - weighted / sum_exp  # H = log Z - E_p[z'], z' = z - max
        correct = target_logit >= 0  # the target's logit is the maximum: it is the argmax (ties count)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, shifted, entropy, torch.log(sum_exp))
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(correct)
        return entropy, correct

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor, _grad_correct):
        softmax, shifted, entropy, log_sum = ctx.saved_tensors
        # dH/dz_v = -p_v (log p_v + H), log p_v = z'_v - log Z; every rank forms its own slice
        log_p = shifted - log_sum.unsqueeze(-1)
        grad = torch.where(softmax > 0, -softmax * (log_p + entropy.unsqueeze(-1)), torch.zeros_like(softmax))
        return (grad * grad_entropy.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_confident_entropy(logits: torch.Tensor, target: torch.Tensor,
                                     tp_group: Optional[dist.ProcessGroup]) -> tuple:
    """(entropy [...] fp32, correct [...] bool) from local logits `[..., V/tp]` and global targets `[...]`:
    the entropy of each token's predictive distribution (differentiable) and whether its target is the
    argmax, as from the full logits, without forming them (LLaDA 2.0's confidence-aware loss reads both).
    Targets are assumed checked (vocab_parallel_cross_entropy's check)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must agree "
                         "on every dim but the last (vocabulary)")
    return _VocabParallelConfidentEntropy.apply(logits, target, tp_group)
