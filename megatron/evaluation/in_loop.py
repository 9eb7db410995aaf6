"""lm-eval tasks on the live model during training (--lm-eval-tasks, megatron/training/lm_eval_args.py).

The adapter's `MegaDLMsLM` runs over a `Backend` built from the model being trained (no
checkpoint round trip), the run's tokenizer and its DLM config, so the numbers are those
tools/lm_eval_harness.py reports on a checkpoint saved at that iteration, with the same model_args.

Every rank runs lm-eval over all the requests, each with world size 1 from lm-eval's point of
view: under tensor and expert parallelism and FSDP2 the forward is a collective, so every rank
must make the same forwards in the same order, which splitting requests over the replicas would
not guarantee. The scores are functions of the weights and the seed alone (scoring.py seeds each
pair by its context), so the ranks agree; rank 0 prints and records them. The price: each rank
spends the single-process evaluation time.

The model runs in eval mode under no_grad and returns to train mode. lm-eval reseeds python's,
numpy's and torch's generators, so every RNG state of the run is saved before and restored
after: a run trains bit-identically with and without the evaluation.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import Dict, List, Optional

import torch
from torch import nn

from megatron.core.distributed.data_parallel import unwrap, whole_weights
from megatron.core.inference.pipelined import sampling_chunks
from megatron.core.errors import InputError
from megatron.training.configs import LMEvalConfig
from megatron.training.rng_state import capture_rng_state, restore_rng_state

__all__ = ["InLoopEvaluation", "build_in_loop_evaluation", "numeric_metrics", "inference_ready"]

Metrics = Dict[str, Dict[str, float]]


def build_in_loop_evaluation(config: Optional[LMEvalConfig], model: nn.Module, tokenizer, device: torch.device,
                             logger) -> Optional["InLoopEvaluation"]:
    """The evaluation of --lm-eval-tasks, or None without them (lm-eval is then never imported)."""
    if config is None or not config.lm_eval_tasks:
        return None
    return InLoopEvaluation(config, model, tokenizer, device, logger)


def _task_manager(tasks: List[str], include_path: Optional[str]):
    """lm-eval's task index: the include path alone when it holds every task named (indexing lm-eval's
    own thousands of YAML files takes tens of seconds), else with lm-eval's tasks. Unknown names fail now."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([task]) for task in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    missing = [task for task in tasks if not manager.match_tasks([task])]
    if missing:
        where = f" nor in --lm-eval-include-path {include_path}" if include_path else ""
        raise InputError(f"--lm-eval-tasks: {', '.join(missing)} is not one of lm-eval's tasks{where}; "
                         "`lm-eval ls tasks` lists them")
    return manager


def _live_backend(model: nn.Module, tokenizer):
    """The adapter's Backend over the model being trained (the DDP wrapper removed)."""
    from megatron.evaluation.lm_eval_adapter import Backend

    inner = unwrap(model)
    return Backend(inner.inference_forward, inner.running_mode, inner.dlm_config.mask_token_id,
                   inner.trained_pattern(), inner.config.max_position_embeddings, tokenizer.eod,
                   tokenizer.tokenize, tokenizer.detokenize, kv_cache=True, select=True)


@contextmanager
def inference_ready(model: nn.Module):
    """The live model as its inference_forward needs it: under FSDP2 its weights gathered for the duration
    (data_parallel.whole_weights), sequence parallelism off (GPTModel.sequence_parallel_off: whole sequences,
    the same weights)."""
    with whole_weights(model), ExitStack() as chunks:
        for chunk in sampling_chunks(model):  # a pipeline's model chunks each
            chunks.enter_context(chunk.sequence_parallel_off())
        yield


def numeric_metrics(results: Optional[dict]) -> Metrics:
    """{task: {metric: value}} of every number lm-eval reports ("acc,none" -> acc; another filter f ->
    acc_f; strings such as an alias or "N/A" are left out), and the examples it scored (samples)."""
    metrics: Metrics = {}
    counts = (results or {}).get("n-samples") or {}
    for task, values in ((results or {}).get("results") or {}).items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, selector = key.partition(",")
            metrics.setdefault(task, {})[metric if selector == "none" else f"{metric}_{selector}"] = float(value)
        if task in counts and task in metrics:
            metrics[task]["samples"] = float(counts[task]["effective"])
    return metrics


class InLoopEvaluation:
    """The --lm-eval-tasks of a run: `due` says when, `run` evaluates the live model and logs."""

    def __init__(self, config: LMEvalConfig, model: nn.Module, tokenizer, device: torch.device, logger) -> None:
        from lm_eval.utils import simple_parse_args_string

        from megatron.evaluation.lm_eval_adapter import MegaDLMsLM

        self.config, self.logger = config, logger
        self.task_manager = _task_manager(list(config.lm_eval_tasks), config.lm_eval_include_path)
        options = simple_parse_args_string(config.lm_eval_model_args or "")
        try:
            self.lm = MegaDLMsLM(backend=_live_backend(model, tokenizer), device=str(device), **options)
        except ValueError as error:  # the adapter's one-line message about a model_args value
            raise InputError(f"--lm-eval-model-args: {error}") from None
        self.lm._rank, self.lm._world_size = 0, 1  # every rank scores everything (module docstring)
        self.history: Dict[int, Metrics] = {}
        """{iteration: metrics} of every evaluation; empty metrics on the ranks lm-eval reports nothing on."""

    def due(self, iteration: int, final: bool = False) -> bool:
        """Every --lm-eval-interval iterations; at the end (`final`) unless this iteration was just done."""
        if final:
            return iteration not in self.history
        return iteration % self.config.lm_eval_interval == 0

    def run(self, model: nn.Module, iteration: int) -> Metrics:
        """Evaluate the tasks on `model` as it is now; print one line per task and record every metric."""
        import lm_eval

        start, rng, training = time.time(), capture_rng_state(model), model.training
        dlm = unwrap(model).dlm_config
        if dlm.block_size_schedule:  # a curriculum's blocks: those of the last trained step, as validation's
            self.lm.backend.pattern["attention_block_size"] = dlm.block_size_at(max(iteration - 1, 0))
        model.eval()
        try:
            with torch.no_grad(), inference_ready(model):
                results = lm_eval.simple_evaluate(model=self.lm, tasks=list(self.config.lm_eval_tasks),
                                                  limit=self.config.lm_eval_limit, task_manager=self.task_manager,
                                                  log_samples=False)
        finally:
            model.train(training)
            restore_rng_state(model, rng)
        metrics = self.history[iteration] = numeric_metrics(results)
        self._log(metrics, iteration, time.time() - start)
        return metrics

    def _log(self, metrics: Metrics, iteration: int, seconds: float) -> None:
        if self.logger is None or not metrics:
            return
        self.logger.print(f" lm-eval at iteration {iteration} ({seconds:.1f} s):")
        scalars = {}
        for task, values in metrics.items():
            self.logger.print(f" lm-eval {task} | " + " | ".join(f"{name}: {value:.6g}" for name, value in
                                                                  values.items()) + " |")
            scalars.update({f"lm-eval/{task}/{name}": value for name, value in values.items()})
        self.logger.on_scalars(scalars, iteration)
