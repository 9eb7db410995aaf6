"""Per-token log-probabilities of sampled completions under the policy, with gradients: what the
policy-gradient objectives (objectives.py) weigh. One forward of the training model (GPTModel.forward
with labels: its per-token cross-entropy is -log p at each labelled position), so every layout the
training forward supports computes them. `[B, P + T]` rows hold the prompt (P tokens) then the
completion (T tokens); the result is `[B, T]`, one value per completion token.

- `ar` (GRPO on an autoregressive policy; JustGRPO's AR-order decoding of a DLM takes the same path on
  a joint AR + DLM model): exact, log p(y_j | prompt, y_<j) from one causal forward.
- `diffu_grpo` (d1): a one-step estimate for a masked-diffusion policy: the whole completion masked, each
  prompt token masked with probability `prompt_mask_prob` (a fresh draw each inner step, which d1 uses
  as a regulariser), log p(y_j | the partly masked prompt) read at every completion position in one
  forward. Biased (it scores every token against a fully masked completion, the t = 1 term of the ELBO
  alone) but with low variance and one forward.
- `coupled` (DiffuCoder's coupled-GRPO): two forwards under complementary masks of the completion (a
  random fraction t in [`t_min`, `t_max`] masked in the first, the rest in the second): each token is
  scored once, in the forward where it is masked, conditioned on the other part of the completion; the
  pair lowers the variance of the ELBO-style estimate log_likelihood's Monte Carlo ELBO draws.
The draws take a `torch.Generator` on the host (as log_likelihood's masks do), so the same seed gives
the same masks on every rank and device.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ESTIMATORS", "ar_logprobs", "diffu_grpo_logprobs", "coupled_logprobs"]

ESTIMATORS = ("ar", "diffu_grpo", "coupled")


def _check(sequence: torch.Tensor, prompt_length: int) -> int:
    if sequence.dim() != 2 or not 0 < prompt_length < sequence.shape[1]:
        raise ValueError(f"sequence {tuple(sequence.shape)} must be [B, P + T] with a prompt of 0 < P = "
                         f"{prompt_length} < P + T tokens")
    return sequence.shape[1] - prompt_length


def ar_logprobs(model, sequence: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[B, T] exact log p(y_j | prompt, y_<j) of the completion under a causal forward (an AR policy,
    or a joint AR + DLM model's clean half read causally)."""
    completion = _check(sequence, prompt_length)
    labels = torch.roll(sequence, shifts=-1, dims=1)  # position i predicts token i + 1
    weights = torch.zeros(sequence.shape, dtype=torch.float32, device=sequence.device)
    weights[:, prompt_length - 1:-1] = 1.0
    per_token, _ = model.vanilla_forward(sequence, labels=labels, loss_weights=weights, loss_normalizer=1.0)
    return -per_token[:, prompt_length - 1:prompt_length - 1 + completion]


def _difflm_logprobs(model, noisy: torch.Tensor, sequence: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """[B, L] log p of the clean tokens at the `scored` positions of a DLM forward on `noisy` (0 elsewhere)."""
    output = model.difflm_forward(noisy, labels=sequence, loss_weights=scored.to(torch.float32), loss_normalizer=1.0)
    return -output[0] * scored


def diffu_grpo_logprobs(model, sequence: torch.Tensor, prompt_length: int, mask_token_id: int,
                        prompt_mask_prob: float = 0.15, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[B, T] d1's one-step estimate of log p(y_j | prompt): the completion masked, the prompt partly."""
    completion = _check(sequence, prompt_length)
    draw = torch.rand(sequence.shape[0], prompt_length, generator=generator).to(sequence.device)
    masked = torch.zeros(sequence.shape, dtype=torch.bool, device=sequence.device)
    masked[:, :prompt_length] = draw < prompt_mask_prob
    masked[:, prompt_length:] = True
    scored = torch.zeros_like(masked)
    scored[:, prompt_length:] = True
    logp = _difflm_logprobs(model, sequence.masked_fill(masked, mask_token_id), sequence, scored)
    return logp[:, prompt_length:prompt_length + completion]


def coupled_logprobs(model, sequence: torch.Tensor, prompt_length: int, mask_token_id: int,
                     t_min: float = 0.2, t_max: float = 0.8,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[B, T] coupled-GRPO's estimate: each completion token's log p from the one of two complementary
    masks that hides it, the other part of the completion visible (one forward of 2B rows)."""
    completion = _check(sequence, prompt_length)
    if completion < 2:
        raise ValueError("coupled_logprobs splits the completion in two complementary masks: it needs 2 tokens or more")
    batch = sequence.shape[0]
    t = t_min + (t_max - t_min) * torch.rand(batch, 1, generator=generator)
    ranks = torch.rand(batch, completion, generator=generator).argsort(dim=1).argsort(dim=1)
    first = (ranks < (t * completion).round().clamp(1, completion - 1)).to(sequence.device)  # some, not all
    hidden = torch.zeros(2 * batch, sequence.shape[1], dtype=torch.bool, device=sequence.device)
    hidden[:batch, prompt_length:] = first
    hidden[batch:, prompt_length:] = ~first
    rows = sequence.repeat(2, 1)
    logp = _difflm_logprobs(model, rows.masked_fill(hidden, mask_token_id), rows, hidden)
    return (logp[:batch] + logp[batch:])[:, prompt_length:prompt_length + completion]
