"""One policy-gradient micro-batch through the training schedules (pipeline_parallel/schedules.py).

`rl_forward_step` keeps the schedules' contract: every pipeline stage runs the estimator's forward of
the micro-batch's completions (estimators.estimator_batch: the same ids, labels and masks on every rank,
its masks drawn from each row's own seed), and the last stage's `loss_func` turns the per-token
losses into completion log-probabilities and those into the policy loss (objectives.policy_loss) as
(loss sum, normalizer), which the loop sums over micro-batches and replicas and divides once, as it
does the pretraining loss. So an RL update runs under every layout the training forward does, with
exactly the gradients of one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Tuple

import torch

from megatron.core.distributed.data_parallel import unwrap
from megatron.core.inference.pipelined import PipelineStages
from megatron.core.pipeline_parallel.chunks import model_chunks
from megatron.rl import spg
from megatron.rl.estimators import ESTIMATORS, EstimatorBatch, check_policy, completion_logprobs, estimator_batch
from megatron.rl.objectives import NORMALIZATIONS, policy_loss

__all__ = ["KINDS", "RLConfig", "RolloutBatch", "rl_forward_step", "reference_logprobs"]

KINDS = ESTIMATORS + ("spg",)
"""The update's estimators: estimators.ESTIMATORS' per-token log-probs under the clipped surrogate, and
spg.py's sandwiched sequence bounds."""
UPDATE_STATISTICS = ("clip fraction", "kl", "ratio")
"""What the clipped update records of each micro-batch (RolloutBatch.stats): per completion token."""


@dataclass(frozen=True)
class RLConfig:
    """The policy-gradient update's settings (the `--rl-*` flags)."""

    estimator: str = "diffu_grpo"
    """How the completion's log-probabilities are computed: one of estimators.ESTIMATORS."""
    mask_token_id: Optional[int] = None
    """The DLM's mask token (the masking estimators)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """PPO's ratio clip, [1 - low, 1 + high] (DAPO raises `high`)."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference policy (0: no reference forward needed)."""
    normalization: str = "sequence"
    """`sequence` (GRPO: each completion's token mean) or `token` (DAPO: every token alike)."""
    prompt_mask_prob: float = 0.15
    """diffu_grpo: the share of prompt tokens masked in each estimate (d1); spg: of the visible tokens."""
    spg_samples: int = 2
    spg_block_length: int = 32
    spg_beta: float = 1.5
    spg_mix: float = 0.5
    """spg: masked copies per completion, their block, the upper bound's beta and its mixture weight."""

    def validate(self) -> "RLConfig":
        if self.estimator not in KINDS:
            raise ValueError(f"RLConfig.estimator={self.estimator!r} is not one of {', '.join(KINDS)}")
        if self.spg_samples < 1 or self.spg_block_length < 1 or self.spg_beta < 1.0 or not 0.0 <= self.spg_mix <= 1.0:
            raise ValueError(f"RLConfig: spg_samples={self.spg_samples} and spg_block_length={self.spg_block_length} "
                             f"must be >= 1, spg_beta={self.spg_beta} >= 1 and spg_mix={self.spg_mix} in [0, 1]")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"RLConfig.normalization={self.normalization!r} is not one of "
                             f"{', '.join(NORMALIZATIONS)}")
        if not 0.0 <= self.prompt_mask_prob <= 1.0:
            raise ValueError(f"RLConfig: prompt_mask_prob={self.prompt_mask_prob} must be in [0, 1]")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0 and self.beta >= 0.0):
            raise ValueError(f"RLConfig: clip_low={self.clip_low} must be in [0, 1), clip_high={self.clip_high} "
                             f"and beta={self.beta} >= 0")
        if self.estimator == "spg" and self.beta:
            raise ValueError(f"RLConfig: the spg estimator takes no KL term; beta={self.beta} must be 0")
        return self


@dataclass
class RolloutBatch:
    """A micro-batch of sampled completions with what the update needs of them."""

    sequence: torch.Tensor
    """[B, P + T] prompt then completion ids."""
    prompt_length: int
    completion_mask: torch.Tensor
    """[B, T] bool: the completion tokens that count (up to and with the first EOS)."""
    advantages: torch.Tensor
    """[B] (objectives.group_advantages of the rewards)."""
    old_logp: Optional[torch.Tensor]
    """[B, T] the log-probabilities under the policy that sampled (detached; the estimator's, same seed).
    None: the first update on fresh rollouts, whose policy is the sampler's: the ratio is 1 (with its
    gradient), and the update stores the values here for later inner steps on the same rollouts."""
    seeds: torch.Tensor
    """[B] integers seeding each row's estimator masks (the same on every rank: keyed by the row, as the
    corruption is by the sample)."""
    ref_logp: Optional[torch.Tensor] = None
    """[B, T] under the frozen reference policy (with RLConfig.beta > 0)."""
    document_ids: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    """[B, P + T] with left-padded prompts (rollouts.row_layout): the padding apart, positions from the first
    real token, as the sampler read the row; None without padding."""
    stats: Optional[torch.Tensor] = None
    """After an update's forward (not SPG's): [completion tokens, then each UPDATE_STATISTICS summed over
    them], for the log."""


def _estimate(batch: RolloutBatch, config: RLConfig) -> EstimatorBatch:
    if config.estimator == "spg":
        return spg.spg_batch(batch.sequence, batch.prompt_length, config.mask_token_id, batch.completion_mask,
                             config.spg_samples, config.spg_block_length, batch.seeds,
                             prompt_mask_prob=config.prompt_mask_prob)
    return estimator_batch(config.estimator, batch.sequence, batch.prompt_length, config.mask_token_id,
                           prompt_mask_prob=config.prompt_mask_prob, seeds=batch.seeds)


def _forward(model: torch.nn.Module, batch: RolloutBatch, estimate: EstimatorBatch, config: RLConfig):
    """The estimator's forward of `batch` on `model` (the per-token losses, or a stage's hidden states)."""
    inner = unwrap(model)
    check_policy(config.estimator, inner.dlm_config)
    if inner.context.active:
        raise ValueError("the RL step reads each completion's per-token losses whole, which context parallelism "
                         "splits over ranks: use --context-parallel-size 1 for RL")
    blocks = {} if estimate.block_size is None else {"block_size": estimate.block_size}
    repeat = estimate.input_ids.shape[0] // batch.sequence.shape[0]  # coupled's mask pair, SPG's masked copies
    layout = {name: value.repeat(repeat, 1) for name, value in
              (("document_ids", batch.document_ids), ("position_ids", batch.position_ids)) if value is not None}
    return model(estimate.input_ids, labels=estimate.labels, loss_weights=estimate.loss_weights,
                 loss_normalizer=1.0, **blocks, **layout)


def rl_forward_step(batch: RolloutBatch, model: torch.nn.Module, config: RLConfig):
    """(output, loss_func) for the schedules: the estimator's forward of `batch` on `model` (a pipeline
    stage's hidden states before the last stage) and the policy loss of the last stage's output."""
    estimate = _estimate(batch, config)
    return _forward(model, batch, estimate, config), partial(rl_loss_func, batch, estimate, config)


@torch.no_grad()
def reference_logprobs(batch: RolloutBatch, model: torch.nn.Module, config: RLConfig,
                       stages: Optional[PipelineStages] = None) -> Optional[torch.Tensor]:
    """[B, T] the estimator's log-probs of `batch` under `model` (the frozen reference policy, eval mode),
    with the masks the update draws (each row's seed): RolloutBatch.ref_logp. Under pipeline parallelism
    (`stages`: the policy's) every stage runs its part of `model`, and only the last stage, whose loss
    reads them, gets the values (None elsewhere)."""
    estimate = _estimate(batch, config)
    if stages is None:
        return completion_logprobs(estimate, _forward(model, batch, estimate, config)[0]).float()
    chunks = model_chunks(model)
    output = stages.forward(lambda index, received: _forward(chunks[index], batch, estimate, config), chunks)
    return None if output is None else completion_logprobs(estimate, output[0]).float()


def rl_loss_func(batch: RolloutBatch, estimate: EstimatorBatch, config: RLConfig,
                 output) -> Tuple[torch.Tensor, torch.Tensor]:
    """(policy loss sum, normalizer) of the last stage's (per-token losses, loss[, terms]) output."""
    logp = completion_logprobs(estimate, output[0])
    if config.estimator == "spg":  # [S B, T] -> the sandwiched bounds of each row
        rows, width = batch.sequence.shape[0], logp.shape[1]
        scored = estimate.loss_weights[:, batch.prompt_length:] > 0
        return spg.spg_loss(logp.view(-1, rows, width), scored.view(-1, rows, width), batch.completion_mask,
                            batch.advantages, beta=config.spg_beta, mix=config.spg_mix)
    if batch.old_logp is None:  # on-policy: the sampler's policy is this one (RolloutBatch.old_logp)
        batch.old_logp = logp.detach()
    loss_sum, normalizer, stats = policy_loss(logp, batch.old_logp, batch.advantages, batch.completion_mask,
                                              batch.ref_logp, beta=config.beta, clip_low=config.clip_low,
                                              clip_high=config.clip_high, normalization=config.normalization)
    tokens = batch.completion_mask.sum().to(torch.float64)
    batch.stats = torch.stack([tokens] + [stats[name].detach().double() * tokens for name in UPDATE_STATISTICS])
    return loss_sum, normalizer
