"""Rollouts: each step's prompts sampled `group_size` times by the policy's own sampler, scored, and cut
into the update's micro-batches (step.RolloutBatch).

- Prompts. Prompt k of the run (k = consumed rows / group size, counted over the whole global batch) is
  the task file's record at position k of an epoch-wise shuffle seeded by the run's seed: a resumed run
  reads the prompts it would have read. Data-parallel replica r takes the step's prompts r, r + dp, ...
  and samples all of each prompt's completions itself, so group advantages need no communication.
- Sampling. The prompt is the chat template's rendering with the generation prompt (the SFT data's
  encoding); prompts of a batch are left-padded, which the sampler masks (generation.generate's
  attention_mask). Each row's sampling noise is its own stream keyed by (seed, prompt k, slot) (the
  sampler's per-row `seeds`), never the global RNG (which dropout uses): every tensor-parallel peer samples
  the same completions, and a completion does not depend on the rows batched with it, so data-parallel
  replicas sample what one process samples (up to the model's arithmetic on a batch of another shape).
- The update reads each row as the sampler did: where a micro-batch holds padding, its forward gets
  document ids (padding apart from the row) and positions counted from the first real token. A
  completion counts up to and with its first EOS (`completion_mask`).
- Each row's estimator seed is a function of (seed, prompt k, slot), the same on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.rl import objectives
from megatron.rl.step import RolloutBatch
from megatron.rl.tasks import TaskRecord
from megatron.training.tokenizer import chat_template

__all__ = ["RolloutConfig", "PromptOrder", "PromptEncoder", "Rollouts", "completion_mask", "row_layout",
           "sample_rollouts", "micro_batches"]

ADVANTAGES = ("grpo", "dr_grpo")
SAMPLING_SALT = 0x5A3C_96E1_0F7B_2D48  # a row's sampling seed: its estimator seed ^ this (two unrelated streams)


@dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are sampled and scored (the `--rl-*` flags of custom_args/rl.py)."""

    group_size: int = 8
    """Completions per prompt (G)."""
    gen_length: int = 128
    """Tokens each completion may take (the sampler's canvas)."""
    temperature: float = 1.0
    block_length: Optional[int] = None
    """DLM sampler's semi-autoregressive block (None: the whole completion; block-diffusion models use their own)."""
    steps: Optional[int] = None
    """DLM denoising steps (None: one token a step)."""
    threshold: Optional[float] = None
    """DLM threshold decoding (Fast-dLLM): commit every token above it."""
    cache: Optional[str] = None
    """DLM KV cache (Fast-dLLM's prefix or dual; generation.py), None: every step runs the whole canvas."""
    cuda_graphs: bool = False
    """Replay CUDA graphs (GPTModel.generate(cuda_graphs=True))."""
    advantage: str = "grpo"
    """grpo: the reward minus its group's mean over the group's std; dr_grpo: not divided."""
    inner_steps: int = 1
    """Optimizer steps on each step's rollouts (PPO's inner epochs): 1 is on-policy."""
    seed: int = 1234


class PromptOrder:
    """Task index of the run's k-th prompt: the records in a fresh shuffle each epoch, keyed by the seed."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self._epoch, self._order = -1, None

    def __call__(self, k: int) -> int:
        epoch = k // self.count
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(self._order[k % self.count])


class PromptEncoder:
    """A task's prompt as the model reads it: the chat template with its generation prompt."""

    def __init__(self, tokenizer, template: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.encoder = chat_template.ChatEncoder(tokenizer, chat_template.resolve_template(template, tokenizer)[0])

    def __call__(self, text: str) -> List[int]:
        ids = self.encoder.text_ids(self.encoder.render([{"role": "user", "content": text}], True))
        bos = self.tokenizer.bos
        return [bos] + ids if bos is not None and (not ids or ids[0] != bos) else ids


def completion_mask(completions: torch.Tensor, eos: int) -> torch.Tensor:
    """[B, T] bool: each completion's tokens up to and with its first EOS (all of them without one)."""
    before = (completions == eos).long().cumsum(dim=1)
    return (before == 0) | ((before == 1) & (completions == eos))


def row_layout(real: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(document ids, position ids) [B, L] of left-padded rows whose real tokens are `real` [B, L]:
    the padding is document 0, the row document 1; positions count from the first real token."""
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    return real.long(), positions


@dataclass
class Rollouts:
    """One replica's rollouts of a step: G completions of each of its prompts, with their rewards."""

    sequence: torch.Tensor
    """[N G, P + T] left-padded prompt then completion."""
    real: torch.Tensor
    """[N G, P + T] bool: not padding."""
    prompt_length: int
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    """[N G] float32."""
    seeds: torch.Tensor
    """[N G] int64 estimator seeds."""
    entropy: torch.Tensor
    """[N G, T] float32: the policy's entropy at each completion token, as the sampler drew it."""
    seconds: float
    """Wall time of the sampling."""
    texts: List[str] = field(default_factory=list)
    """[N G] the completions as the reward processes read them (to and without their first EOS)."""


def sample_rollouts(model, encoder: PromptEncoder, records: Sequence[TaskRecord], indices: Sequence[int],
                    config: RolloutConfig, score) -> Rollouts:
    """Sample G completions of each record (`indices`: their run-wide prompt numbers) with `model` (the
    unwrapped GPTModel, in eval mode) and score them with `score(pairs) -> rewards`."""
    tokenizer, group = encoder.tokenizer, config.group_size
    device = next(model.parameters()).device
    prompts = [encoder(record.prompt) for record in records]
    length = max(map(len, prompts))
    pad = tokenizer.eod
    ids = torch.full((len(prompts), length), pad, dtype=torch.long)
    real = torch.zeros(len(prompts), length, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        real[row, length - len(prompt):] = True
    ids, real = ids.repeat_interleave(group, dim=0).to(device), real.repeat_interleave(group, dim=0).to(device)
    seeds = [(config.seed * 1_000_003 + k * group + slot) % (2 ** 62) for k in indices for slot in range(group)]
    entropy = torch.zeros(ids.shape[0], config.gen_length, device=device)
    start = time.perf_counter()
    sequence = model.generate(ids, attention_mask=real, eos_token_id=pad, pad_token_id=pad, entropy=entropy,
                              **_sampling_options(model, config, [SAMPLING_SALT ^ seed for seed in seeds]))
    seconds = time.perf_counter() - start
    completions = sequence[:, length:]
    mask = completion_mask(completions, pad)
    texts = [tokenizer.detokenize([t for t, kept in zip(row, keep) if kept and t != pad])
             for row, keep in zip(completions.tolist(), mask.tolist())]
    rewards = torch.tensor(score([(records[row // group], text) for row, text in enumerate(texts)]),
                           dtype=torch.float32)
    full_real = torch.cat([real, torch.ones_like(completions, dtype=torch.bool)], dim=1)
    return Rollouts(sequence, full_real, length, mask, rewards, torch.tensor(seeds, dtype=torch.long),
                    entropy.cpu(), seconds, texts)


def _sampling_options(model, config: RolloutConfig, seeds: List[int]) -> Dict[str, object]:
    options: Dict[str, object] = {"gen_length": config.gen_length, "temperature": config.temperature,
                                  "seeds": seeds}
    if config.cuda_graphs:
        options["cuda_graphs"] = True
    if model.running_mode == "vanilla":
        return options
    dlm = {"steps": config.steps, "threshold": config.threshold, "cache": config.cache}
    if model.dlm_config.effective_mask_type != "block_diffusion":
        dlm["block_length"] = config.block_length
    return options | {name: value for name, value in dlm.items() if value is not None}


def micro_batches(rollouts: Rollouts, config: RolloutConfig, micro_batch_size: int) -> List[RolloutBatch]:
    """The update's micro-batches of `micro_batch_size` rows, with the group advantages."""
    advantages = objectives.group_advantages(rollouts.rewards, config.group_size, scale=config.advantage == "grpo")
    device = rollouts.sequence.device
    batches = []
    for first in range(0, rollouts.sequence.shape[0], micro_batch_size):
        rows = slice(first, first + micro_batch_size)
        real = rollouts.real[rows]
        documents, positions = row_layout(real) if not bool(real.all()) else (None, None)
        batches.append(RolloutBatch(rollouts.sequence[rows], rollouts.prompt_length, rollouts.completion_mask[rows],
                                    advantages[rows].to(device), None, rollouts.seeds[rows],
                                    document_ids=documents, position_ids=positions))
    return batches
