"""Flags of the in-loop lm-eval evaluation (megatron/evaluation/in_loop.py) and their checks.

MegaDLMs declared --use-on-the-fly-eval for this but never implemented it; here the tasks
themselves (--lm-eval-tasks) turn it on and --use-on-the-fly-eval is kept as the switch its
scripts pass. Everything that can be checked without lm-eval's task index is checked here, at
start-up, so a run does not train for hours to fail at its first evaluation.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Collection

from megatron.training.configs import LMEvalConfig

# Model options the run decides itself: the weights, the tokenizer and the device are the run's.
RUN_OWNED_MODEL_ARGS = ("load", "pretrained", "tokenizer", "device", "backend")


def _tasks_given(args: argparse.Namespace) -> bool:
    return bool(args.lm_eval_tasks)


# (flag's dest, what it needs as typed, the test): appended to arguments.FLAG_NEEDS.
LM_EVAL_FLAG_NEEDS = tuple(
    (dest, "--lm-eval-tasks T [T ...] (the lm-eval tasks to run)", _tasks_given)
    for dest in ("lm_eval_interval", "lm_eval_include_path", "lm_eval_limit", "lm_eval_model_args",
                 "use_on_the_fly_eval"))


def add_lm_eval_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("lm-eval tasks during training (megatron/evaluation/in_loop.py; needs lm-eval)")
    g.add_argument("--lm-eval-tasks", nargs="+", metavar="TASK",
                   help="lm-evaluation-harness tasks (or groups) to run on the live model every --lm-eval-interval "
                        "iterations and after the last; every metric goes to the console and to tensorboard as "
                        "lm-eval/<task>/<metric>. Default: none.")
    g.add_argument("--lm-eval-interval", type=int,
                   help="Run the --lm-eval-tasks every N iterations (default: --eval-interval).")
    g.add_argument("--lm-eval-include-path",
                   help="A folder of task YAML files (lm-eval's include_path), for local tasks; when it holds "
                        "every task named, lm-eval's own thousands of tasks are not indexed.")
    g.add_argument("--lm-eval-limit", type=int, help="Examples per task (default: all).")
    g.add_argument("--lm-eval-model-args",
                   help="Options of the megadlms lm-eval model as key=value,... (mc_num, batch_size, cfg, "
                        "gen_length, steps, block_length, remasking, threshold, cache, seed, max_length); the "
                        "weights, tokenizer and device are the run's.")


def _check_model_args(text: str) -> None:
    """key=value items, none of them an option the run owns (unknown keys: the adapter, at build)."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--lm-eval-model-args: {item!r} is not key=value; write e.g. mc_num=8,gen_length=32")
        if key.strip() in RUN_OWNED_MODEL_ARGS:
            raise ValueError(f"--lm-eval-model-args: {key.strip()}= is the run's own (the live model, its "
                             "tokenizer and device); drop it")


def _check_layout(args: argparse.Namespace) -> None:
    """The live model's inference forward needs the whole model and whole sequences on every rank (sequence
    parallelism is switched off for it, which MoE layers under tensor parallelism cannot follow)."""
    for dest, ok in (("pipeline_model_parallel_size", args.pipeline_model_parallel_size == 1),
                     ("context_parallel_size", args.context_parallel_size == 1)):
        if not ok:
            shown = f"--{dest.replace('_', '-')} {getattr(args, dest)}"
            raise ValueError(f"--lm-eval-tasks scores with the live model's inference forward, which needs the whole "
                             f"model and sequence on each rank; {shown} splits them: evaluate a saved checkpoint "
                             "with tools/lm_eval_harness.py instead")
    if args.sequence_parallel and getattr(args, "num_experts", None):
        raise ValueError("--lm-eval-tasks scores with sequence parallelism off, which MoE layers under tensor "
                         "parallelism cannot do (--sequence-parallel with --num-experts): evaluate a saved "
                         "checkpoint with tools/lm_eval_harness.py instead")


def validate_lm_eval_args(args: argparse.Namespace, given: Collection[str] = frozenset()) -> None:
    """Fill --lm-eval-interval and --difflm-eval-mc-samples and raise ValueError naming the flag and the fix."""
    if getattr(args, "model_running_mode", "vanilla") == "vanilla":
        # The AR loss is exact: nothing to average (DLM_ONLY_FLAGS warns when the flag was given).
        args.difflm_eval_mc_samples = 1
    if args.lm_eval_interval is not None and args.lm_eval_interval < 1:
        raise ValueError(f"--lm-eval-interval {args.lm_eval_interval} must be >= 1")
    if args.lm_eval_limit is not None and args.lm_eval_limit < 1:
        raise ValueError(f"--lm-eval-limit {args.lm_eval_limit} must be >= 1 (leave it out for every example)")
    if _tasks_given(args):
        if args.tokenizer_type == "NullTokenizer":
            raise ValueError("--lm-eval-tasks needs a text tokenizer (lm-eval's tasks are text); pass "
                             "--tokenizer-type and its files")
        _check_layout(args)
        _check_model_args(args.lm_eval_model_args or "")
        if importlib.util.find_spec("lm_eval") is None:
            raise ImportError("--lm-eval-tasks needs the lm-evaluation-harness: pip install lm-eval")
        if args.lm_eval_interval is None:
            args.lm_eval_interval = args.eval_interval
    args.lm_eval_config = LMEvalConfig.from_args(args)
