"""Per-token log-probabilities of sampled completions under the policy, with gradients: what the
policy-gradient objectives (objectives.py) weigh. One forward of the training model (GPTModel.forward
with labels: its per-token cross-entropy is -log p at each labelled position), so every layout the
training forward supports computes them. `[B, P + T]` rows hold the prompt (P tokens) then the
completion (T tokens); the result is `[B, T]`, one value per completion token.

- `ar` (GRPO on an autoregressive policy; JustGRPO's AR-order decoding of a DLM takes the same path on
  a joint AR + DLM model): exact, log p(y_j | prompt, y_<j) from one causal forward.
- `ar_order` (JustGRPO: GRPO in AR order): exact for a block-diffusion policy decoded left to right: its
  [x_t ; x_0] forward at blocks of 1, the completion masked in x_t, so token j sees the clean tokens before
  it and nothing after, log p(y_j | prompt, y_<j) for every j in one forward.
- `diffu_grpo` (d1): a one-step estimate for a masked-diffusion policy: the whole completion masked, each
  prompt token masked with probability `prompt_mask_prob` (a fresh draw each inner step, which d1 uses
  as a regulariser), log p(y_j | the partly masked prompt) read at every completion position in one
  forward. Biased (it scores every token against a fully masked completion, the t = 1 term of the ELBO
  alone) but with low variance and one forward.
- `coupled` (DiffuCoder's coupled-GRPO): two forwards under complementary masks of the completion (a
  random fraction t in [`t_min`, `t_max`] masked in the first, the rest in the second): each token is
  scored once, in the forward where it is masked, conditioned on the other part of the completion; the
  pair lowers the variance of the ELBO-style estimate log_likelihood's Monte Carlo ELBO draws.
`estimator_batch` builds an estimator's forward (ids, labels, weights) and `completion_logprobs` reads
its per-token losses, so a training step runs it through the model under any layout (the RL forward
step); `ar_logprobs` and the others run it on a whole model at once. Each row's draws come from a host generator
of its own seed (as log_likelihood's masks come from a host generator), so the same seeds give the same
masks on every rank, device and grouping of rows into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

__all__ = ["ESTIMATORS", "EstimatorBatch", "estimator_batch", "completion_logprobs", "check_policy", "ar_logprobs",
           "ar_order_logprobs", "diffu_grpo_logprobs", "coupled_logprobs"]

ESTIMATORS = ("ar", "ar_order", "diffu_grpo", "coupled")


@dataclass
class EstimatorBatch:
    """One estimator's forward: the model reads `input_ids` with `labels` and `loss_weights` (its per-token
    cross-entropy is -log p at the weighted positions); `completion_logprobs` reads the result."""

    kind: str
    input_ids: torch.Tensor
    """[R, P + T]: R = B rows (`ar`, `diffu_grpo`) or 2B (`coupled`: the two complementary masks)."""
    labels: torch.Tensor
    loss_weights: torch.Tensor
    """float32 [R, P + T]: 1 at the positions whose log p is read."""
    prompt_length: int
    block_size: Optional[int] = None
    """The forward's blocks (GPTModel.forward(block_size=)): 1 for `ar_order`; None: the model's own."""


def _check(sequence: torch.Tensor, prompt_length: int) -> int:
    if sequence.dim() != 2 or not 0 < prompt_length < sequence.shape[1]:
        raise ValueError(f"sequence {tuple(sequence.shape)} must be [B, P + T] with a prompt of 0 < P = "
                         f"{prompt_length} < P + T tokens")
    return sequence.shape[1] - prompt_length


def estimator_batch(kind: str, sequence: torch.Tensor, prompt_length: int, mask_token_id: Optional[int] = None, *,
                    prompt_mask_prob: float = 0.15, t_min: float = 0.2, t_max: float = 0.8,
                    seeds: Optional[Sequence[int]] = None) -> EstimatorBatch:
    """The forward `kind` (one of ESTIMATORS) runs for completions `sequence` [B, P + T]; each row's random
    masks drawn on the host from its own seed (`seeds`, default 0 each), so a row's estimate is the same
    whichever micro-batch, replica or rank holds it."""
    generators = _row_generators(sequence.shape[0], seeds)
    completion = _check(sequence, prompt_length)
    if kind == "ar":  # position i predicts token i + 1: the completion from P - 1 on
        weights = torch.zeros(sequence.shape, dtype=torch.float32, device=sequence.device)
        weights[:, prompt_length - 1:-1] = 1.0
        return EstimatorBatch(kind, sequence, torch.roll(sequence, shifts=-1, dims=1), weights, prompt_length)
    if not isinstance(mask_token_id, int):
        raise ValueError(f"the {kind} estimator masks tokens: give the mask token id")
    if kind == "ar_order":  # block diffusion at blocks of 1: token j sees the clean tokens before it, exactly
        scored = torch.zeros(sequence.shape, dtype=torch.bool, device=sequence.device)
        scored[:, prompt_length:] = True
        return EstimatorBatch(kind, sequence.masked_fill(scored, mask_token_id), sequence, scored.to(torch.float32),
                              prompt_length, block_size=1)
    if kind == "diffu_grpo":
        hidden = torch.zeros(sequence.shape, dtype=torch.bool, device=sequence.device)
        # Read from the prompt's end: the token d places before the completion takes the row's d-th draw, so
        # its mask does not depend on the left padding (the batch's longest prompt); the stream is prefix-stable.
        draw = torch.stack([torch.rand(prompt_length, generator=row).flip(0) for row in generators])
        draw = draw.to(sequence.device)
        hidden[:, :prompt_length] = draw < prompt_mask_prob
        hidden[:, prompt_length:] = True
        scored = torch.zeros_like(hidden)
        scored[:, prompt_length:] = True
        rows = sequence
    elif kind == "coupled":
        scored = _complementary_halves(sequence, prompt_length, completion, t_min, t_max, generators)
        hidden, rows = scored, sequence.repeat(2, 1)
    else:
        raise ValueError(f"estimator {kind!r} is not one of {', '.join(ESTIMATORS)}")
    return EstimatorBatch(kind, rows.masked_fill(hidden, mask_token_id), rows, scored.to(torch.float32),
                          prompt_length)


def _complementary_halves(sequence, prompt_length: int, completion: int, t_min: float, t_max: float,
                          generators: List[torch.Generator]) -> torch.Tensor:
    """[2B, P + T] bool: a random fraction t of each completion hidden in the first B rows, the rest in the
    last B (each token in exactly one)."""
    if completion < 2:
        raise ValueError("the coupled estimator splits the completion in two complementary masks: it needs 2 "
                         "tokens or more")
    batch = sequence.shape[0]
    t = t_min + (t_max - t_min) * torch.stack([torch.rand(1, generator=row) for row in generators])
    ranks = torch.stack([torch.rand(completion, generator=row) for row in generators]).argsort(dim=1).argsort(dim=1)
    first = (ranks < (t * completion).round().clamp(1, completion - 1)).to(sequence.device)  # some, not all
    hidden = torch.zeros(2 * batch, sequence.shape[1], dtype=torch.bool, device=sequence.device)
    hidden[:batch, prompt_length:] = first
    hidden[batch:, prompt_length:] = ~first
    return hidden


def _row_generators(rows: int, seeds: Optional[Sequence[int]]) -> List[torch.Generator]:
    seeds = [0] * rows if seeds is None else [int(seed) for seed in seeds]
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} seeds for {rows} rows: give one seed a row")
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def completion_logprobs(batch: EstimatorBatch, per_token: torch.Tensor) -> torch.Tensor:
    """[B, T] log p of each completion token from the model's per-token cross-entropy [R, P + T] on `batch`."""
    start, width = batch.prompt_length, batch.input_ids.shape[1] - batch.prompt_length
    logp = -per_token * batch.loss_weights
    if batch.kind == "ar":
        return logp[:, start - 1:start - 1 + width]
    if batch.kind == "coupled":
        rows = logp.shape[0] // 2
        logp = logp[:rows] + logp[rows:]
    return logp[:, start:start + width]


def ar_logprobs(model, sequence: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[B, T] exact log p(y_j | prompt, y_<j) of the completion under a causal forward (an AR policy)."""
    batch = estimator_batch("ar", sequence, prompt_length)
    check_policy("ar", model.dlm_config)
    per_token, _ = model.vanilla_forward(batch.input_ids, labels=batch.labels, loss_weights=batch.loss_weights,
                                         loss_normalizer=1.0)
    return completion_logprobs(batch, per_token)


def check_policy(kind: str, dlm) -> None:
    """ValueError unless estimator `kind` applies to a policy of DLMConfig `dlm`."""
    if kind == "ar" and dlm.is_diffusion:
        raise ValueError(f"the ar estimator reads a causal forward: the policy is {dlm.model_running_mode}; use "
                         "ar_order (block diffusion), diffu_grpo or coupled")
    if kind != "ar" and not dlm.is_diffusion:
        raise ValueError(f"the {kind} estimator masks tokens for a diffusion policy; an autoregressive one uses ar")
    if kind != "ar_order" and dlm.block_diffusion:  # the masking estimators and SPG's
        raise ValueError(f"the {kind} estimator would score a block-diffusion policy under blocks counted from each "
                         "row's first slot, while the sampler counts them from its first prompt token (left-padded "
                         "prompts sample under other blocks); use ar_order (--rl-algorithm ar_order_grpo), exact "
                         "for it")
    if kind == "ar_order" and not dlm.block_diffusion:
        raise ValueError("the ar_order estimator reads block diffusion at blocks of 1; this policy is not a "
                         "block-diffusion model (--difflm-block-diffusion): use diffu_grpo or coupled")


def _difflm_logprobs(model, batch: EstimatorBatch) -> torch.Tensor:
    check_policy(batch.kind, model.dlm_config)
    output = model.difflm_forward(batch.input_ids, labels=batch.labels, loss_weights=batch.loss_weights,
                                  loss_normalizer=1.0, block_size=batch.block_size)
    return completion_logprobs(batch, output[0])


def ar_order_logprobs(model, sequence: torch.Tensor, prompt_length: int, mask_token_id: int) -> torch.Tensor:
    """[B, T] exact log p(y_j | prompt, y_<j) of a block-diffusion policy decoded left to right (JustGRPO's
    AR order): its [x_t ; x_0] forward at blocks of 1 with the completion masked, one forward."""
    return _difflm_logprobs(model, estimator_batch("ar_order", sequence, prompt_length, mask_token_id))


def diffu_grpo_logprobs(model, sequence: torch.Tensor, prompt_length: int, mask_token_id: int,
                        prompt_mask_prob: float = 0.15, seeds: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[B, T] d1's one-step estimate of log p(y_j | prompt): the completion masked, the prompt partly."""
    return _difflm_logprobs(model, estimator_batch("diffu_grpo", sequence, prompt_length, mask_token_id,
                                                   prompt_mask_prob=prompt_mask_prob, seeds=seeds))


def coupled_logprobs(model, sequence: torch.Tensor, prompt_length: int, mask_token_id: int,
                     t_min: float = 0.2, t_max: float = 0.8,
                     seeds: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[B, T] coupled-GRPO's estimate: each completion token's log p from the one of two complementary
    masks that hides it, the other part of the completion visible (one forward of 2B rows)."""
    return _difflm_logprobs(model, estimator_batch("coupled", sequence, prompt_length, mask_token_id,
                                                   t_min=t_min, t_max=t_max, seeds=seeds))
