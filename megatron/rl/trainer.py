"""RLTrainer: the training loop (megatron/training/training.py's Trainer) with rollouts for batches.

Every `inner_steps` iterations the loop samples fresh rollouts (rollouts.py) with the live model, then
each iteration is one ordinary training step over them: the schedules run step.rl_forward_step on each
micro-batch, the loop divides the summed policy loss once, clips and steps, logs, evaluates and saves
as pretraining does. A checkpoint falls on a rollout boundary (posttrain_rl.py checks the intervals),
so resuming samples the next prompts with the saved weights and goes on bit for bit.

Validation is the held-out reward: greedy (temperature 0), one completion per held-out task, the tasks
split over the data-parallel replicas and the sums all-reduced.

Rewards are scored once per model-parallel group: its first tensor-parallel rank of the first pipeline
stage runs the reward processes and broadcasts the rewards to the group's other ranks, which sampled the
same completions. So the peers train on the same rewards even where a checker times out, fails or draws
at random on one of them, and a group runs one set of reward processes, not one a rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel import unwrap
from megatron.core.inference.pipelined import PipelineStages, sampling_chunks
from megatron.core.parallel_state import ParallelContext
from megatron.core.pipeline_parallel.chunks import ModelChunks
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.evaluation.in_loop import inference_ready
from megatron.rl.rewards import RewardWorkers
from megatron.rl.rollouts import PromptEncoder, PromptOrder, RolloutConfig, Rollouts, micro_batches, sample_rollouts
from megatron.rl.step import UPDATE_STATISTICS, RLConfig, reference_logprobs
from megatron.rl.tasks import TaskRecord
from megatron.training.checkpointing import load_model_weights
from megatron.training.rng_state import capture_rng_state, restore_rng_state
from megatron.training.training import Trainer

__all__ = ["RLTasks", "RLTrainer"]


@dataclasses.dataclass
class RLTasks:
    """What an RL run samples from: its tasks, the prompt encoding and the reward processes' settings."""

    train: List[TaskRecord]
    valid: List[TaskRecord]
    encoder: PromptEncoder
    rollout: RolloutConfig
    eval_prompts: int = 0
    log_completions: int = 0
    """Held-out completions each validation prints (the logging rank's first ones)."""
    reward_workers: int = 2
    reward_timeout_s: float = 5.0
    update: RLConfig = dataclasses.field(default_factory=RLConfig)
    """The update's settings (its estimator scores the reference policy too)."""
    reference: Optional[str] = None
    """--rl-reference: the checkpoint of the frozen reference policy (with update.beta > 0)."""


class RLTrainer(Trainer):
    def __init__(self, *args, tasks: RLTasks, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tasks = tasks
        self.order = PromptOrder(len(tasks.train), tasks.rollout.seed)
        self.train_loader = lambda consumed: iter(())  # the batches come from rollouts (train_step)
        self.batches: Optional[list] = None
        self.workers: Optional[RewardWorkers] = None
        self.rollout_rewards: List[float] = []
        """The mean reward of each batch of rollouts, over all replicas."""
        self.rollout_entropy: List[float] = []
        """The policy's mean entropy (nats) over each batch's completion tokens, at sampling."""
        self.update_statistics: List[dict] = []
        """Each step's clipped-update statistics ({name: value per completion token}, UPDATE_STATISTICS)."""
        self.update_throughput: List[float] = []
        """Each step's update tokens/s (`_log_update`)."""
        self.batch_tokens = 0.0
        """This replica's tokens in the rollout rows (padding apart) the updates read."""
        self.reference: Optional[torch.nn.Module] = None
        """The frozen reference policy (update.beta > 0), loaded at the first rollouts."""
        self.stages = PipelineStages(self.model, self.links, self.groups.pp) if self.pipelined else None
        """Under pipeline parallelism: every stage samples together (inference/pipelined.py)."""

    def train(self):
        scorer = group_rank(self.groups.tp) == 0 and group_rank(self.groups.pp) == 0
        with (RewardWorkers(self.tasks.reward_workers, self.tasks.reward_timeout_s) if scorer
              else contextlib.nullcontext()) as workers:
            self.workers = workers
            try:
                return super().train()
            finally:
                self.workers = None

    # ------------------------------------------------------------------ rollouts
    def _sample(self, records: Sequence[TaskRecord], indices: Sequence[int], config: RolloutConfig) -> Rollouts:
        """Rollouts of `records` by the live model (eval mode, no gradients, the run's RNG untouched)."""
        model, rng = self.stages or unwrap(self.model), capture_rng_state(self.model)
        self.model.eval()
        try:
            with torch.no_grad(), inference_ready(self.model):
                return sample_rollouts(model, self.tasks.encoder, records, indices, config, self._score)
        finally:
            self.model.train()
            restore_rng_state(self.model, rng)

    def _score(self, pairs) -> List[float]:
        """The rewards of (record, completion) `pairs`: the scoring rank's (the one with reward processes),
        broadcast over tensor then pipeline parallelism (module docstring)."""
        rewards = torch.zeros(len(pairs), dtype=torch.float32, device=self.runtime.device)
        if self.workers is not None:
            rewards.copy_(torch.tensor(self.workers.score(pairs), dtype=torch.float32))
        for group in (self.groups.tp, self.groups.pp):
            if group_size(group) > 1:
                dist.broadcast(rewards, group=group, group_src=0)
        return rewards.cpu().tolist()

    def _replica_prompts(self, first: int, count: int) -> List[int]:
        """This replica's share (every dp-th) of the run's prompts [first, first + count)."""
        replicas, rank = group_size(self.groups.dp), group_rank(self.groups.dp)
        return list(range(first + rank, first + count, replicas))

    def train_step(self, data_iterator):
        config = self.tasks.rollout
        start = None
        if self.batches is None or self.state.iteration % config.inner_steps == 0:
            group = config.group_size
            indices = self._replica_prompts(self.state.consumed_train_samples // group,
                                            self.config.global_batch_size // group)
            rollouts = self._sample([self.tasks.train[self.order(k)] for k in indices], indices, config)
            start = time.perf_counter()  # the update: everything after the rollouts
            self.batches = micro_batches(rollouts, config, self.config.micro_batch_size)
            self.batch_tokens = float(rollouts.real.sum())
            if self.tasks.update.beta > 0:
                reference = self._reference_policy()
                for batch in self.batches:
                    batch.ref_logp = reference_logprobs(batch, reference, self.tasks.update, self.stages)
            self._log_rollouts(rollouts)
        start = time.perf_counter() if start is None else start
        result = super().train_step(iter(self.batches))
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize()
        self._log_update(time.perf_counter() - start)
        return result

    def _log_update(self, seconds: float) -> None:
        """The update's tokens/s (the rollout rows' tokens, padding apart, over all replicas, per second of
        everything the step did after its rollouts) and the clipped update's statistics per completion token
        (the ratio to the sampling policy, the share of tokens clipped, the KL to the reference; not SPG's),
        over the replicas; printed on the log interval."""
        parts = [batch.stats for batch in self.batches if batch.stats is not None]
        sums = self._sums([self.batch_tokens] + (torch.stack(parts).sum(dim=0).tolist() if parts else []))
        self.update_throughput.append(sums[0] / max(seconds, 1e-9))
        values = {"rl/update tokens per second": self.update_throughput[-1]}
        if parts:
            totals = sums[1:]
            self.update_statistics.append({name: total / max(totals[0], 1.0)
                                           for name, total in zip(UPDATE_STATISTICS, totals[1:])})
            values |= {f"rl/{name}": value for name, value in self.update_statistics[-1].items()}
        if self.logger is None:
            return
        iteration = self.state.iteration + 1
        self.logger.on_scalars(values, iteration)
        if iteration % self.logger.config.log_interval == 0:
            statistics = [f"{name}: {values[f'rl/{name}']:.4f}" for name in UPDATE_STATISTICS] if parts else []
            self.logger.print(f" update at iteration {iteration} | " + " | ".join(
                statistics + [f"update tokens/s: {self.update_throughput[-1]:.1f}"]) + " |")

    def _reference_policy(self) -> torch.nn.Module:
        """The policy's architecture with --rl-reference's weights, frozen (this rank's part under tensor and
        pipeline parallelism: a second copy of its weights, no gradients or optimizer state). Built without
        touching the run's RNG, and loaded from its checkpoint on every start, resumed runs included."""
        if self.reference is None:
            policies, rng = sampling_chunks(self.model), capture_rng_state(self.model)
            context = ParallelContext.extend(self.groups, sequence_parallel=False,
                                             rng_tracker=policies[0].rng_tracker)
            with torch.device(self.runtime.device):
                chunks = [type(policy)(policy.config, policy.dlm_config, pre_process=policy.pre_process,
                                       post_process=policy.post_process, layer_range=policy.decoder.layer_range,
                                       pg=context) for policy in policies]
            restore_rng_state(self.model, rng)
            reference = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
            load_model_weights(self.tasks.reference, reference, flag="--rl-reference")
            self.reference = reference.to(next(policies[0].parameters()).dtype).requires_grad_(False).eval()
        return self.reference

    def _sums(self, values: List[float]) -> List[float]:
        """`values` summed over the data-parallel replicas (tensor-parallel peers hold the same)."""
        total = torch.tensor(values, dtype=torch.float64, device=self.runtime.device)
        if group_size(self.groups.dp) > 1:
            dist.all_reduce(total, group=self.groups.dp)
        return total.tolist()

    def _log_rollouts(self, rollouts: Rollouts) -> None:
        mask = rollouts.completion_mask
        finished = mask.sum(dim=1) < mask.shape[1]
        rows, reward, length, done, generated, seconds, entropy = self._sums(
            [float(mask.shape[0]), float(rollouts.rewards.sum()), float(mask.sum()), float(finished.sum()),
             float(mask.numel()), rollouts.seconds, float((rollouts.entropy * mask.cpu()).sum())])
        self.rollout_rewards.append(reward / rows)
        self.rollout_entropy.append(entropy / max(length, 1.0))
        if self.logger is None:
            return
        replicas = group_size(self.groups.dp)
        scalars = {"rl/reward": reward / rows, "rl/completion tokens": length / rows, "rl/finished": done / rows,
                   "rl/entropy": self.rollout_entropy[-1],
                   "rl/rollout tokens per second": generated / (seconds / replicas)}
        self.logger.print(f" rollouts before iteration {self.state.iteration + 1} | reward: {scalars['rl/reward']:.4f} "
                          f"| completion tokens: {scalars['rl/completion tokens']:.1f} | finished: "
                          f"{scalars['rl/finished']:.3f} | entropy: {scalars['rl/entropy']:.4f} | rollout tokens/s: "
                          f"{scalars['rl/rollout tokens per second']:.1f} |")
        self.logger.on_scalars(scalars, self.state.iteration + 1)

    # ------------------------------------------------------------------ validation
    def _evaluates(self) -> bool:
        return bool(self.tasks.valid) and self.tasks.eval_prompts > 0 and self.config.eval_iters > 0

    def evaluate_and_log(self) -> float:
        """The mean reward of greedy completions of the first --rl-eval-prompts held-out tasks."""
        count = min(self.tasks.eval_prompts, len(self.tasks.valid))
        indices = self._replica_prompts(0, count)
        config = dataclasses.replace(self.tasks.rollout, group_size=1, temperature=0.0)
        # a replica past the last held-out task samples nothing
        rollouts = self._sample([self.tasks.valid[k] for k in indices], indices, config) if indices else None
        rewards, texts = (torch.zeros(0), []) if rollouts is None else (rollouts.rewards, rollouts.texts)
        total, rows = self._sums([float(rewards.sum()), float(rewards.numel())])
        reward = total / max(rows, 1.0)
        if self.logger is not None:
            self.logger.print(f" validation reward at iteration {self.state.iteration} | reward: {reward:.4f} | "
                              f"prompts: {int(rows)} |")
            self.logger.on_scalars({"rl/validation reward": reward}, self.state.iteration)
            for k, text, value in list(zip(indices, texts, rewards.tolist()))[:self.tasks.log_completions]:
                self.logger.print(f" validation completion {k} | reward: {value:.4f} | answer: "
                                  f"{json.dumps(self.tasks.valid[k].answer)} | completion: {json.dumps(text)} |")
        return reward
