"""Policy-gradient objectives of RL post-training, per completion token.

Every function takes per-token log-probabilities of the completion tokens, `[B, T]` with a `[B, T]`
mask of the tokens that count: exact for an AR policy, an estimate for a DLM (the estimators of
log_likelihood's family). They are GRPO's pieces:
- `group_advantages`: each completion's reward against its group's (the G completions of one prompt):
  (r - mean) / (std + eps), or only centred (Dr. GRPO's `scale=False`);
- `clipped_surrogate`: PPO's clipped importance ratio, exp(logp - old_logp), in [1 - low, 1 + high]
  (DAPO's asymmetric "clip higher" when high > low); with old_logp = logp.detach() (one inner step) its
  gradient is the plain policy gradient A * grad logp;
- `kl_k3`: the KL penalty to a frozen reference policy, the k3 estimator exp(d) - d - 1 with
  d = ref_logp - logp (unbiased for KL(pi || ref) under samples of pi, never negative);
- `policy_loss`: the three together as (loss sum, normalizer), the form the training loop sums over
  micro-batches and replicas and divides once (distributed/loss_normalization.py): per sequence (GRPO:
  each completion's token mean, then the mean over completions) or per token (DAPO: over all tokens).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["NORMALIZATIONS", "group_advantages", "clipped_surrogate", "kl_k3", "policy_loss"]

NORMALIZATIONS = ("sequence", "token")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """[N] advantages of N = prompts x `group_size` rewards, each group contiguous: the reward minus its
    group's mean, divided by the group's standard deviation (Bessel-corrected, as TRL's GRPO) plus `eps`
    unless `scale` is False. A group whose rewards are all equal gets advantage 0."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}; give "
                         "[prompts x group size] rewards, each prompt's completions together")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [B, T], whether each token's ratio was clipped [B, T]): -min(r A, clip(r) A), r the
    importance ratio exp(logp - old_logp), A the completion's advantage ([B], broadcast over its tokens)."""
    ratio = torch.exp(logp - old_logp)
    advantage = advantages.to(logp.dtype)[:, None]
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantage
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1, d = ref_logp - logp (>= 0; 0 where equal)."""
    difference = ref_logp - logp
    return torch.exp(difference) - difference - 1.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                ref_logp: torch.Tensor = None, beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2,
                normalization: str = "sequence") -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """(loss sum, normalizer, statistics) of the clipped surrogate plus `beta` times the KL to the reference
    over the `mask`ed tokens: `sequence` sums each completion's token mean (normalizer: completions with a
    token), `token` sums every token (normalizer: tokens). Statistics (detached, for the log): the clipped
    fraction of tokens, the mean KL, the mean ratio."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization {normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
    if not (logp.shape == old_logp.shape == mask.shape) or advantages.shape != logp.shape[:1]:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} "
                         f"must be [B, T] and advantages {tuple(advantages.shape)} [B]")
    weights = mask.to(logp.dtype)
    per_token, clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta:
        per_token = per_token + beta * kl
    tokens = weights.sum(dim=1)
    if normalization == "sequence":
        loss_sum = ((per_token * weights).sum(dim=1) / tokens.clamp(min=1)).sum()
        normalizer = (tokens > 0).sum().to(logp.dtype)
    else:
        loss_sum, normalizer = (per_token * weights).sum(), tokens.sum()
    count = weights.sum().clamp(min=1)
    stats = {"clip fraction": (clipped * weights).sum() / count, "kl": (kl.detach() * weights).sum() / count,
             "ratio": (torch.exp(logp - old_logp).detach() * weights).sum() / count}
    return loss_sum, normalizer, stats
