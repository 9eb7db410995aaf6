"""SPG (Sandwiched Policy Gradient) for masked-diffusion policies: a lower bound of log p for completions
with a positive advantage, an upper bound for the others, so the policy-gradient objective itself is
bounded from below on both sides of the baseline.

Each completion is scored under `samples` block-wise random masks (SPG's block_random): a block of
`block_length` completion tokens is drawn; in it a uniform number (at least 1) of tokens is hidden; every
later position is hidden too; earlier ones stay visible, and so does the prompt, but for each visible token
(the prompt's and the completion's before the block) hidden with probability `prompt_mask_prob`, as SPG's
reference does with its p_mask_prompt. Scored are the hidden tokens inside the completion (up to its first
EOS; so, as in the reference, an earlier completion token hidden that way is scored too). Per row, over its
samples j with hidden fraction t_j of its completion:

- lower bound (ELBO-like, `positive` advantages): the mean over samples of each sample's mean log p of
  its scored tokens;
- upper bound (`negative`): per token, the mean over samples of p^beta / t_j where scored (0 elsewhere),
  its log averaged over the tokens some sample scored, divided by beta (a Renyi-style bound, beta >= 1);
  `mix` blends it with the lower bound, mix * upper + (1 - mix) * lower (SPG's mixture, 0.5 by default).

The loss is -A_i times row i's bound, each row weighted by its completion length, over the summed
lengths: (loss sum, normalizer) for the loop's one global division. No importance ratio is clipped: SPG
is REINFORCE with the bounds (inner steps re-use the rollouts on-policy as its reference does).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from megatron.rl.estimators import EstimatorBatch

__all__ = ["spg_masks", "visible_masks", "spg_batch", "sequence_bounds", "spg_loss"]


def spg_masks(completion_mask: torch.Tensor, samples: int, block_length: int,
              generators: List[torch.Generator]) -> torch.Tensor:
    """[samples * B, T] bool: the hidden completion positions of each sample (sample-major rows)."""
    batch, width = completion_mask.shape
    lengths = completion_mask.sum(dim=1).clamp(min=1).tolist()
    hidden = torch.zeros(samples, batch, width, dtype=torch.bool)
    for row, (length, generator) in enumerate(zip(lengths, generators)):
        blocks = -(-length // block_length)
        for sample in range(samples):
            block = int(torch.randint(blocks, (1,), generator=generator))
            start, end = block * block_length, min((block + 1) * block_length, length)
            count = int(torch.randint(1, end - start + 1, (1,), generator=generator))
            chosen = torch.randperm(end - start, generator=generator)[:count] + start
            hidden[sample, row, chosen] = True
            hidden[sample, row, end:] = True
    return hidden.view(samples * batch, width).to(completion_mask.device)


def visible_masks(hidden: torch.Tensor, samples: int, probability: float,
                  generators: List[torch.Generator]) -> torch.Tensor:
    """[samples * B, L] bool: each token `hidden` leaves visible, hidden with `probability` (a row's draws
    after its block masks, from its own generator)."""
    draws = torch.zeros(samples, len(generators), hidden.shape[1])
    for row, generator in enumerate(generators):
        for sample in range(samples):
            draws[sample, row] = torch.rand(hidden.shape[1], generator=generator)
    return (draws.view_as(hidden).to(hidden.device) < probability) & ~hidden


def spg_batch(sequence: torch.Tensor, prompt_length: int, mask_token_id: int, completion_mask: torch.Tensor,
              samples: int, block_length: int, seeds: Optional[Sequence[int]] = None,
              prompt_mask_prob: float = 0.0) -> EstimatorBatch:
    """The forward of `samples` masked copies of each row [B, P + T] (rows sample-major: j * B + i)."""
    if not isinstance(mask_token_id, int):
        raise ValueError("the spg estimator masks tokens: give the mask token id")
    seeds = [0] * sequence.shape[0] if seeds is None else [int(seed) for seed in seeds]
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    hidden = torch.zeros(samples * sequence.shape[0], sequence.shape[1], dtype=torch.bool, device=sequence.device)
    hidden[:, prompt_length:] = spg_masks(completion_mask, samples, block_length, generators)
    if prompt_mask_prob > 0:
        hidden |= visible_masks(hidden, samples, prompt_mask_prob, generators)
    rows = sequence.repeat(samples, 1)
    scored = hidden & torch.cat([torch.zeros_like(sequence[:, :prompt_length], dtype=torch.bool),
                                 completion_mask], dim=1).repeat(samples, 1)
    return EstimatorBatch("spg", rows.masked_fill(hidden, mask_token_id), rows, scored.to(torch.float32),
                          prompt_length)


def sequence_bounds(logp: torch.Tensor, scored: torch.Tensor, completion_mask: torch.Tensor,
                    beta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """([B] lower, [B] upper) bounds of log p(completion) from [S, B, T] log-probs at the `scored` positions."""
    scored = scored.to(logp.dtype)
    per_sample = (logp * scored).sum(dim=2) / scored.sum(dim=2).clamp(min=1)
    lower = per_sample.mean(dim=0)
    t = scored.sum(dim=2) / completion_mask.sum(dim=1).clamp(min=1).to(logp.dtype)  # [S, B]
    powered = torch.exp(beta * logp) * scored / t.clamp(min=1e-8)[:, :, None]
    average = powered.mean(dim=0)  # [B, T]
    seen = average > 0
    logs = torch.log(torch.where(seen, average, torch.ones_like(average)))
    upper = (logs * seen).sum(dim=1) / seen.sum(dim=1).clamp(min=1) / beta
    return lower, upper


def spg_loss(logp: torch.Tensor, scored: torch.Tensor, completion_mask: torch.Tensor, advantages: torch.Tensor,
             beta: float = 1.5, mix: float = 0.5) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, normalizer): -A times the lower bound where A > 0, the mixed upper bound elsewhere, each
    row weighted by its completion length."""
    lower, upper = sequence_bounds(logp, scored, completion_mask, beta)
    bound = torch.where(advantages > 0, lower, mix * upper + (1.0 - mix) * lower)
    lengths = completion_mask.sum(dim=1).to(logp.dtype)
    return (-advantages.to(logp.dtype) * bound * lengths).sum(), lengths.sum()
