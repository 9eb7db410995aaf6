"""Command-line flags of reinforcement learning (argument group "rl"), read by posttrain_rl.py.

They build megatron/rl's RLConfig (the update), RolloutConfig (sampling) and RLTasks (tasks, rewards);
`rl_settings` checks them against each other and against the run's other flags, one line per problem.
"""

from __future__ import annotations

import argparse
from typing import Tuple

import torch

from custom_args.difflm import add_difflm_args
from megatron.rl.estimators import check_policy
from megatron.rl.objectives import NORMALIZATIONS
from megatron.rl.rollouts import ADVANTAGES, RolloutConfig
from megatron.rl.step import RLConfig

# --rl-algorithm -> the estimator of the completions' log-probabilities (megatron/rl/estimators.py)
ALGORITHMS = {"grpo": "ar", "diffu_grpo": "diffu_grpo", "coupled_grpo": "coupled", "ar_order_grpo": "ar_order",
              "spg": "spg"}


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_difflm_args(parser)
    parser.set_defaults(mock_data=True)  # the prompts come from --rl-task, not from token files
    g = parser.add_argument_group("rl", "reinforcement learning with verifiable rewards (posttrain_rl.py)")
    g.add_argument("--rl-task", help="Task file (JSON Lines: prompt, answer, reward kind; megatron/rl/tasks.py; "
                                     "tools/build_rl_task.py writes Countdown, Sudoku and arithmetic ones).")
    g.add_argument("--rl-valid-task", help="Held-out task file: the validation reward (greedy, one completion "
                                           "a task) every --eval-interval iterations.")
    g.add_argument("--rl-eval-prompts", type=int, default=64, help="Held-out tasks a validation scores.")
    g.add_argument("--rl-log-completions", type=int, default=0,
                   help="Held-out completions each validation prints (the first ones, with their answers and "
                        "rewards): what the greedy policy writes.")
    g.add_argument("--rl-algorithm", default="diffu_grpo", choices=sorted(ALGORITHMS),
                   help="grpo: exact token log-probs of an AR policy (vanilla; also a joint AR + DLM one); "
                        "diffu_grpo: d1's one-step estimate (masked completion, randomly masked prompt); "
                        "coupled_grpo: DiffuCoder's complementary mask pair; ar_order_grpo: a block-diffusion "
                        "policy scored left to right, exactly (JustGRPO); spg: sandwiched bounds, a lower one for "
                        "positive advantages, an upper one for negative (megatron/rl/spg.py).")
    g.add_argument("--rl-group-size", type=int, default=8, help="Completions per prompt (G); --global-batch-size "
                                                                "counts completions.")
    g.add_argument("--rl-inner-steps", type=int, default=1,
                   help="Optimizer steps on each batch of rollouts (PPO epochs); the importance ratio against the "
                        "sampling policy is clipped from the second on.")
    g.add_argument("--rl-clip-low", type=float, default=0.2, help="PPO ratio clip below 1.")
    g.add_argument("--rl-clip-high", type=float, default=0.2, help="PPO ratio clip above 1 (DAPO: 0.28).")
    g.add_argument("--rl-kl-beta", type=float, default=0.0,
                   help="Weight of the KL to the frozen reference policy (k3 estimate, per token); needs "
                        "--rl-reference.")
    g.add_argument("--rl-reference", help="Checkpoint of the reference policy (usually the --load of the first "
                                          "run); loaded on every start, so a resumed run keeps it.")
    g.add_argument("--rl-advantage", default="grpo", choices=ADVANTAGES,
                   help="grpo: reward minus the group mean over the group std; dr_grpo: not divided.")
    g.add_argument("--rl-normalization", default="sequence", choices=NORMALIZATIONS,
                   help="sequence: each completion's token mean (GRPO); token: every token alike (DAPO, Dr. GRPO).")
    g.add_argument("--rl-prompt-mask-prob", type=float, default=0.15,
                   help="diffu_grpo: prompt tokens masked; spg: the tokens its masks leave visible (the prompt, "
                        "the completion before the block) masked.")
    g.add_argument("--rl-spg-samples", type=int, default=2, help="spg: block-masked copies of each completion.")
    g.add_argument("--rl-spg-beta", type=float, default=1.5, help="spg: the upper bound's beta (>= 1).")
    g.add_argument("--rl-spg-mix", type=float, default=0.5,
                   help="spg: weight of the upper bound for negative advantages (the rest the lower bound).")
    g.add_argument("--rl-gen-length", type=int, default=128, help="Tokens a completion may take.")
    g.add_argument("--rl-temperature", type=float, default=1.0, help="Sampling temperature of the rollouts.")
    g.add_argument("--rl-sampling-steps", type=int, help="DLM denoising steps (default: one token a step).")
    g.add_argument("--rl-block-length", type=int, help="DLM semi-autoregressive block of the sampler.")
    g.add_argument("--rl-threshold", type=float, help="DLM threshold decoding of the rollouts (Fast-dLLM).")
    g.add_argument("--rl-cache", choices=("prefix", "dual"),
                   help="DLM rollouts with Fast-dLLM's KV cache, refreshed at each block's first step: prefix or "
                        "dual (approximate: keys and values of committed tokens are reused within a block). An AR "
                        "policy decodes with its exact KV cache always.")
    g.add_argument("--rl-cuda-graphs", action="store_true",
                   help="Replay a captured CUDA graph per forward shape in the rollouts (inference/cuda_graphs.py; "
                        "the graphs read the weights the optimizer updates in place).")
    g.add_argument("--rl-chat-template", default="auto", help="How prompts are rendered (tools/preprocess_data.py "
                                                              "--chat-template's values).")
    g.add_argument("--rl-reward-workers", type=int, default=2, help="Processes that score completions.")
    g.add_argument("--rl-reward-timeout", type=float, default=5.0, help="Seconds a completion's check may take "
                                                                        "(past it: reward 0).")
    return parser


def rl_settings(args: argparse.Namespace) -> Tuple[RLConfig, RolloutConfig]:
    """The update's and the rollouts' configs of the parsed flags; ValueError naming the flag and the fix."""
    if not args.rl_task:
        raise ValueError("--rl-task is required: a task file (tools/build_rl_task.py writes some)")
    if args.data_path or args.train_data_path:
        raise ValueError("RL reads its prompts from --rl-task; drop --data-path/--train-data-path")
    group, inner = args.rl_group_size, args.rl_inner_steps
    if group < 1 or inner < 1 or args.rl_eval_prompts < 0 or args.rl_gen_length < 1 \
            or args.rl_log_completions < 0:
        raise ValueError("--rl-group-size, --rl-inner-steps and --rl-gen-length must be >= 1, --rl-eval-prompts and "
                         "--rl-log-completions >= 0")
    if not 0.0 <= args.rl_prompt_mask_prob <= 1.0:
        raise ValueError(f"--rl-prompt-mask-prob {args.rl_prompt_mask_prob} is a probability: give one in [0, 1]")
    replicas = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                   * args.context_parallel_size)
    if args.global_batch_size % (group * replicas):
        raise ValueError(f"--global-batch-size {args.global_batch_size} (completions) must split into whole groups "
                         f"of --rl-group-size {group} on each of the {replicas} data-parallel replicas")
    for flag, value in (("--save-interval", args.save_interval), ("--train-iters", args.train_iters)):
        if value and value % inner:
            raise ValueError(f"{flag} {value} must be a multiple of --rl-inner-steps {inner}: checkpoints fall "
                             "between batches of rollouts")
    if args.context_parallel_size > 1:
        raise ValueError("rollouts decode with the model's sampler, which needs whole sequences on each rank: use "
                         "tensor (and sequence), pipeline and data parallelism, not --context-parallel-size")
    if args.sequence_parallel and args.num_experts:
        raise ValueError("--sequence-parallel with MoE layers: rollouts sample with sequence parallelism off, which "
                         "MoE layers under tensor parallelism cannot do; drop --sequence-parallel")
    if args.rl_cache and args.dlm_config.model_running_mode == "vanilla":
        raise ValueError(f"--rl-cache {args.rl_cache} is a DLM sampler's cache; an AR policy (--model-running-mode "
                         "vanilla) decodes with its exact KV cache always: drop the flag")
    if args.rl_cuda_graphs and (args.pipeline_model_parallel_size > 1 or not torch.cuda.is_available()):
        raise ValueError("--rl-cuda-graphs needs a CUDA device and one pipeline stage (the stages' sampler runs "
                         "eagerly): drop the flag")
    if args.rl_kl_beta > 0 and not args.rl_reference:
        raise ValueError(f"--rl-kl-beta {args.rl_kl_beta} needs --rl-reference: the checkpoint of the reference "
                         "policy (usually the policy's first --load)")
    estimator = ALGORITHMS[args.rl_algorithm]
    try:
        check_policy(estimator, args.dlm_config)
    except ValueError as error:
        raise ValueError(f"--rl-algorithm {args.rl_algorithm}: {error}") from None
    update = RLConfig(estimator=estimator, mask_token_id=args.dlm_config.mask_token_id, clip_low=args.rl_clip_low,
                      clip_high=args.rl_clip_high, normalization=args.rl_normalization,
                      prompt_mask_prob=args.rl_prompt_mask_prob, spg_samples=args.rl_spg_samples,
                      spg_block_length=args.rl_block_length or 32, spg_beta=args.rl_spg_beta,
                      spg_mix=args.rl_spg_mix, beta=args.rl_kl_beta).validate()
    rollout = RolloutConfig(group_size=group, gen_length=args.rl_gen_length, temperature=args.rl_temperature,
                            block_length=args.rl_block_length, steps=args.rl_sampling_steps,
                            threshold=args.rl_threshold, cache=args.rl_cache, cuda_graphs=args.rl_cuda_graphs,
                            advantage=args.rl_advantage, inner_steps=inner, seed=args.seed)
    return update, rollout
