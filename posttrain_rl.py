"""Reinforcement learning with verifiable rewards for DLMs and AR models (GRPO and its DLM variants).

    torchrun --nproc_per_node=8 posttrain_rl.py --load CKPT --finetune --use-checkpoint-args \
        --rl-task tasks.jsonl --rl-valid-task valid.jsonl --rl-algorithm diffu_grpo --rl-group-size 8 \
        --global-batch-size 256 --micro-batch-size 16 --train-iters 200 --lr 1e-6 ...

Megatron's flags as pretrain_difflm.py reads them, plus the `--rl-*` ones (custom_args/rl.py). Each
step samples G completions of --global-batch-size / G prompts with the policy's own sampler, scores
them in reward processes, and takes a clipped policy-gradient step through the training schedules
(megatron/rl: rollouts.py, trainer.py, step.py); logging, evaluation (the held-out reward),
checkpoints and resume are the training loop's.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from typing import List, Optional

import pretrain_difflm
from custom_args.rl import add_rl_args, rl_settings
from megatron.core.errors import InputError
from megatron.rl.rollouts import PromptEncoder
from megatron.rl.step import RLConfig, rl_forward_step
from megatron.rl.tasks import load_tasks
from megatron.rl.trainer import RLTasks, RLTrainer
from megatron.training import pretrain
from megatron.training.arguments import parse_args

model_provider = pretrain_difflm.model_provider


def train_valid_test_datasets_provider(config, num_samples):
    """No token datasets: the rollouts are the batches (megatron/rl/trainer.py)."""
    return None, None, None


def forward_step(data_iterator, model, ctx, config, rl: RLConfig):
    """One micro-batch of rollouts (step.RolloutBatch) through the policy-gradient loss."""
    return rl_forward_step(next(data_iterator), model, rl)


def build_tasks(args, update, rollout) -> RLTasks:
    """The task files read and checked, and the prompt encoding (InputError / ValueError: one line)."""
    valid = load_tasks(args.rl_valid_task) if args.rl_valid_task else []
    tasks = RLTasks(load_tasks(args.rl_task), valid, PromptEncoder(args.tokenizer, args.rl_chat_template), rollout,
                    eval_prompts=args.rl_eval_prompts, log_completions=args.rl_log_completions,
                    reward_workers=args.rl_reward_workers,
                    reward_timeout_s=args.rl_reward_timeout, update=update, reference=args.rl_reference)
    check_lengths(tasks, args.max_position_embeddings)
    return tasks


def check_lengths(tasks: RLTasks, positions: int) -> None:
    """InputError unless every prompt (as the chat template renders it) and --rl-gen-length fit the model's
    positions: a row counts its positions from its first prompt token."""
    gen_length = tasks.rollout.gen_length
    for flag, records in (("--rl-task", tasks.train), ("--rl-valid-task", tasks.valid)):
        longest = max((len(tasks.encoder(record.prompt)) for record in records), default=0)
        if longest + gen_length > positions:
            raise InputError(f"{flag}: its longest prompt ({longest} tokens with the chat template) and "
                             f"--rl-gen-length {gen_length} need {longest + gen_length} positions, but the model has "
                             f"{positions} (--max-position-embeddings, by default --seq-length); pass --seq-length "
                             f"{longest + gen_length} or more")


def without_step_throughput(args) -> None:
    """--log-throughput's tokens/s, TFLOP/s and MFU count --seq-length tokens a row; an RL row is a prompt and
    a completion of other lengths, so the figures would be wrong: off, with a note (the rollouts line has
    the sampler's tokens/s)."""
    if args.logging_config.log_throughput:
        if not args.check_args:
            print("note: --log-throughput is off for RL: its figures assume rows of --seq-length tokens; the "
                  "rollouts line reports the sampler's tokens/s")
        args.logging_config = dataclasses.replace(args.logging_config, log_throughput=False)


def main(argv: Optional[List[str]] = None):
    args = parse_args(argv, add_rl_args)
    without_step_throughput(args)
    try:
        update, rollout = rl_settings(args)
        tasks = build_tasks(args, update, rollout)
    except (ValueError, OSError) as error:  # InputError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1 if isinstance(error, (InputError, OSError)) else 2)
    if args.check_args:
        return None
    return pretrain(train_valid_test_datasets_provider, model_provider, partial(forward_step, rl=update), args=args,
                    trainer_class=partial(RLTrainer, tasks=tasks))


if __name__ == "__main__":
    main()
