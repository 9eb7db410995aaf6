"""pretrain(): the training loop of MegaDLMs.

The loop reads top to bottom: build (flags -> RunConfig -> process group -> model -> optimizer -> data),
then `Trainer.train()` runs steps; a step is micro-batches of forward/backward with the
gradient all-reduce only on the last, one division by the global number of loss tokens,
clipping, a non-finite check that skips the update, and the optimizer and LR steps.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from functools import partial
from typing import Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.datasets.data_samplers import MegatronPretrainingSampler
from megatron.core.distributed.data_parallel import (
    finalize_gradients,
    is_fully_sharded,
    optimizer_sharding_group,
    unwrap,
    wrap_data_parallel,
)
from megatron.core.distributed.loss_normalization import GlobalBatchLoss
from megatron.core.errors import InputError, user_message
from megatron.core.models.difflm import objective
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import build_optimizer, clip_grad_norm, forget_gradient_scale
from megatron.core.parallel_state import ParallelContext, ParallelState, ProcessGroups, initialize_model_parallel
from megatron.core.pipeline_parallel.chunks import ModelChunks, model_chunks
from megatron.core.pipeline_parallel.layer_split import stage_layer_range
from megatron.core.pipeline_parallel.p2p_communication import PipelineLinks
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.precision.apply import apply_precision
from megatron.core.precision.loss_scale import LossScale, LossScaleConfig
from megatron.core.precision.weight_copies import WeightCopies
from megatron.core.tensor_parallel.random import stage_seed
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.compilation import compile_transformer_layers, training_compile_options
from megatron.core.transformer.moe.balancing import finish_router_step
from megatron.evaluation.in_loop import InLoopEvaluation, build_in_loop_evaluation
from megatron.training.arguments import ExtraArgsProvider, parse_args
from megatron.training.checkpointing import Checkpointer, check_loadable, load_checkpoint
from megatron.training.configs import TrainingConfig
from megatron.training.data_parallel_args import describe as describe_data_parallel
from megatron.training.initialize import Runtime, initialize_distributed, set_deterministic_mode, set_random_seeds
from megatron.training.loop_hooks import LoopHooks
from megatron.training.step_state import StepContext, StepResult, TrainState, validation_stream
from megatron.training.rerun import RerunConfig, RerunMachine
from megatron.training.run_config import RunConfig, run_config
from megatron.training.save_lock import acquire_save_lock
from megatron.training.training_log import TrainingLogger

LossFunc = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


# forward_step(data_iterator, model, ctx, config: RunConfig) -> (output tensor, loss_func); loss_func(output)
# -> (sum of weighted token losses, number of loss tokens).
ForwardStepFunc = Callable[..., Tuple[torch.Tensor, LossFunc]]


class TrainingDiverged(RuntimeError):
    pass


class ExitSignalHandler:
    """--exit-signal-handler: SIGTERM (a scheduler's preemption notice) ends the run cleanly.

    The handler only records the signal; the loop checks it after each step on every rank
    (all-reduced, so all ranks stop together), saves a checkpoint and exits with code 0.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.received = False
        signal.signal(signum, self._record)

    def _record(self, signum, frame) -> None:
        self.received = True


class Trainer:
    def __init__(self, config: TrainingConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: OptimizerParamScheduler, forward_step: ForwardStepFunc,
                 train_loader: Callable[[int], Iterator], valid_loader: Optional[Callable[[], Iterator]],
                 runtime: Runtime, logger: Optional[TrainingLogger] = None,
                 groups: Optional[ProcessGroups] = None, links: Optional[PipelineLinks] = None,
                 hooks: Optional[LoopHooks] = None, rerun_config: Optional[RerunConfig] = None,
                 loss_scale: Optional[LossScaleConfig] = None, loss_parts: Tuple[str, ...] = ()) -> None:
        self.config, self.model, self.optimizer, self.scheduler = config, model, optimizer, scheduler
        self.loss_parts = loss_parts
        """The named terms forward_step's loss adds up (objective.loss_parts), logged apart."""
        self.groups = groups or ProcessGroups()
        self.model_config = getattr(unwrap(model_chunks(model)[0]), "config", None)
        """The TransformerConfig of the model (MoE statistics need its layer count and experts)."""
        self.replica_group = replica_group(self.groups)
        self.forward_step = forward_step
        self.train_loader, self.valid_loader = train_loader, valid_loader
        self.runtime, self.logger = runtime, logger
        self.hooks = hooks or LoopHooks(config, device=runtime.device, logger=logger)
        """Timers, profiler, manual GC, cache emptying, progress file (loop_hooks.py)."""
        self.state = TrainState()
        self.history: List[StepResult] = []
        self.checkpointer: Optional[Checkpointer] = None
        self.signal_handler: Optional[ExitSignalHandler] = None
        self.lm_eval: Optional[InLoopEvaluation] = None
        """--lm-eval-tasks on the live model (megatron/evaluation/in_loop.py); None without them."""
        self.weight_copies: Optional[WeightCopies] = None
        """--cache-low-precision-weights: the linear layers' working copies, refreshed before each step."""
        self.loss_scale = LossScale.build(loss_scale, runtime.device)
        """fp16's loss scaling (PrecisionConfig.loss_scale); a disabled scaler, scale 1, otherwise."""
        self.grad_scaler = self.loss_scale.scaler
        self.fp16 = loss_scale is not None
        self.pipelined, self.links = links is not None and links.size > 1, links
        """The layout's pipeline (one home: the links built from the process groups, and the model's chunks)
        chooses the micro-batch schedule."""
        chunks = len(model_chunks(model))
        self.schedule = get_forward_backward_func(links.size if self.pipelined else 1, chunks if chunks > 1 else None,
                                                  links)
        self.rerun = RerunMachine(rerun_config or RerunConfig(), self.fp16, config.seed,
                                  logger.config.log_interval if logger is not None else 1,
                                  logger.print if logger is not None else (lambda message: None),
                                  runtime.is_main, runtime.device)

    # ------------------------------------------------------------------ one step
    def _forward_backward(self, data_iterator: Iterator, training: bool, iteration: int,
                          first_sample: int, stream: int, batch: Optional[Tuple[int, int]] = None) -> GlobalBatchLoss:
        """Run every micro-batch of a global batch through the schedule; returns its reduced loss.
        `batch`: (global batch size, micro-batches per replica), default the configured ones."""
        global_batch_size, num_microbatches = batch or (self.config.global_batch_size, self.config.num_microbatches)
        loss_scale = None
        if self.fp16 and training:
            # fp16 backpropagates the loss sum scaled by S / (the batch's tokens), so the gradients have a
            # per-token loss's magnitude (Megatron's) and S need not shrink by the token count to fit;
            # the gradient scale multiplies the token count back (_compute_gradients).
            loss_scale = self.grad_scaler.scale(torch.ones((), device=self.runtime.device)) / self._fp16_tokens(
                global_batch_size)

        def forward_step(iterator: Iterator, model: nn.Module, microbatch: int):
            ctx = StepContext(iteration, first_sample, global_batch_size, microbatch, training, stream, loss_scale,
                              iteration if training else max(self.state.iteration - 1, 0))
            return self.forward_step(iterator, model, ctx)

        # the level-2 timers time a pipeline stage's compute (its measured bubble, timers.py)
        clock = self.hooks.timers.compute_clock() if training and self.pipelined else None
        loss = self.schedule(forward_step, data_iterator, self.model, num_microbatches,
                             GlobalBatchLoss(self.runtime.device, self.loss_parts), forward_only=not training,
                             scale_loss=None if loss_scale is None else (lambda loss_sum: loss_sum * loss_scale),
                             clock=clock)
        # Tensor-parallel peers hold the same values: sum over the data-parallel replicas (the loss
        # sums also over the context-parallel ranks, which hold parts of the same sequences; the
        # normalizers, computed on whole sequences, are the same there), then hand the last
        # pipeline stage's values to every stage.
        return loss.reduce(self.replica_group, self.groups.dp, pipeline_group=self.groups.pp)

    def _norm_groups(self) -> dict:
        """The groups a whole-model norm or count adds its ranks' parts over (optimizer.sum_over_layout)."""
        sharded = is_fully_sharded(self.model)
        shard_group, expert_shard_group = shard_groups(self.groups)  # FSDP2's gradient shards
        return dict(tp_group=self.groups.tp, dp_shard_group=shard_group if sharded else None, pp_group=self.groups.pp,
                    expert_group=self.groups.expert_tp_ep,
                    expert_shard_group=expert_shard_group if sharded else None)

    def _compute_gradients(self, data_iterator: Iterator, batch: Tuple[int, int]) -> Tuple[GlobalBatchLoss,
                                                                                          torch.Tensor]:
        """One execution of the step up to the update: every micro-batch's forward and backward, the
        gradient reduction and the clipping; returns the reduced loss and the grad norm."""
        state = self.state
        self.optimizer.zero_grad(set_to_none=True)
        with self.rerun.anomaly_mode():
            batch_loss = self._forward_backward(data_iterator, True, state.iteration, state.consumed_train_samples,
                                                stream=0, batch=batch)
        self.hooks.phase_end("forward-backward")
        self.grad_scaler.unscale_(self.optimizer)
        gradient_scale = finalize_gradients(self.model, batch_loss, self.groups.tp, self.groups.embedding,
                                            self.groups.expert_dp, self.groups.expert_tp)
        if self.fp16:
            gradient_scale = gradient_scale * self._fp16_tokens(batch[0])
        self.hooks.phase_end("all-grads-sync")
        # Without fp16's GradScaler (which sets the optimizer's grad_scale itself) a fused AdamW
        # applies the normalizer and the clipping as it reads the gradients (loss_normalization.py).
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.clip_grad, scale=gradient_scale,
                                   optimizer=None if self.fp16 else self.optimizer, **self._norm_groups())
        return batch_loss, grad_norm

    def _fp16_tokens(self, global_batch_size: int) -> float:
        return float(global_batch_size * self.config.seq_length)

    def _discard_gradients(self) -> None:
        """Undo an execution before its re-run: the gradients, a scale left for a fused AdamW, fp16's
        record that they were unscaled (torch has no public reset) and the routers' counts (the
        expert biases are updated once, after the step's last execution)."""
        self.optimizer.zero_grad(set_to_none=True)
        forget_gradient_scale(self.optimizer)
        if self.fp16:
            self.grad_scaler._per_optimizer_states.pop(id(self.optimizer), None)
        finish_router_step(self.model, self.model_config, 1, update_bias=False)

    def train_step(self, data_iterator: Iterator) -> StepResult:
        iteration = self.state.iteration + 1
        if self.weight_copies is not None:  # weights changed other than by the step (a load) are copied again
            self.weight_copies.refresh()
        batch = self.config.batch_at(self.state.consumed_train_samples)  # grows along a batch ramp
        execution = self.rerun.begin_step(data_iterator, self.model, iteration)
        while True:
            batch_loss, grad_norm = self._compute_gradients(execution.data, batch)
            # One host sync per execution (a re-run happens only on an anomaly): the decision must be
            # the same on every rank, and it is, because the loss is all-reduced and the gradients
            # are synchronised before the norm (rerun.py).
            values = torch.cat([torch.stack([batch_loss.loss.float(), grad_norm.float()]),
                                batch_loss.part_losses.float()]).tolist()
            loss, norm = values[:2]
            verdict = execution.judge(loss, norm)
            if not verdict.rerun:
                break
            self._discard_gradients()
            execution.rewind()
        replicas = group_size(self.groups.dp)
        moe = finish_router_step(self.model, self.model_config, batch[1] * replicas)
        logged = self.rerun.logs(iteration)
        zeros = self.rerun.count_zero_grads(self.model, self._norm_groups()) if logged else None
        if verdict.skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.grad_scaler.step(self.optimizer)
            self.scheduler.advance(batch[0])
        self.loss_scale.update(overflow=verdict.skip)  # fp16 only
        if self.weight_copies is not None:  # --fp8-recipe delayed: the iteration's amaxes into the scales
            self.weight_copies.end_iteration(skipped=verdict.skip)
        forget_gradient_scale(self.optimizer)
        self.hooks.phase_end("optimizer")
        numerics = self.rerun.report(zeros, self.rerun.params_norm(self.model, self._norm_groups())) if logged else None
        return StepResult(loss, norm, float(batch_loss.normalizer), verdict.skip, verdict.nan, moe, batch[0],
                          numerics, dict(zip(self.loss_parts, values[2:])))

    def account(self, result: StepResult) -> None:
        """Count a finished train_step in the run's progress (iteration, samples, tokens, skips), as train()
        does after each; the next step's corruption and batch size follow from it."""
        state = self.state
        state.iteration += 1
        size = result.global_batch_size or self.config.global_batch_size
        state.consumed_train_samples += size
        state.consumed_train_tokens += size * self.config.seq_length
        state.skipped_iterations += int(result.skipped)
        state.nan_iterations += int(result.nan)
        state.consecutive_nan_iterations = state.consecutive_nan_iterations + 1 if result.nan else 0
        if state.consecutive_nan_iterations >= self.config.max_consecutive_nan_iterations:
            raise TrainingDiverged(
                f"{state.consecutive_nan_iterations} iterations in a row had a non-finite loss or grad norm "
                f"(iteration {state.iteration}); lower --lr or check the data. "
                "(--max-consecutive-nan-iterations sets the limit)")

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainState:
        config, state = self.config, self.state
        if config.skip_train:  # --skip-train: the validation loss of the loaded weights, no step
            if self._evaluates():
                self.evaluate_and_log()
            self._lm_eval(final=True)
            return state
        self.model.train()
        self.hooks.train_start(state, config.train_iters)
        data_iterator = self.hooks.data(self.train_loader(state.consumed_train_samples))
        start_time = time.time()
        while state.iteration < config.train_iters:
            self.hooks.step_start(state.iteration)
            result = self.train_step(data_iterator)
            self.history.append(result)
            self.account(result)
            if self.logger is not None:
                self.logger.on_step(state, result, self.scheduler.get_lr(), self.grad_scaler.get_scale()
                                    if self.fp16 else 1.0)
            if self._evaluates() and state.iteration % config.eval_interval == 0:
                self.evaluate_and_log()
            self._lm_eval()
            if self.checkpointer is not None:
                self.checkpointer.finalize(blocking=False, iteration=state.iteration)
                if self.checkpointer.due(state.iteration):
                    self.hooks.save(self)
                elif self.checkpointer.non_persistent_due(state.iteration):  # not a progress-file save
                    self.checkpointer.save(self, non_persistent=True)
            self.hooks.step_end(state.iteration)
            if self._should_exit(start_time):
                break
        if self._evaluates() and state.iteration % config.eval_interval != 0:
            self.evaluate_and_log()
        self._lm_eval(final=True)
        if self.checkpointer is not None:
            if not self.checkpointer.due(state.iteration):
                self.hooks.save(self)  # the end of training is always saved
            self.checkpointer.finalize(blocking=True)
        self.hooks.train_end()
        return state

    def _evaluates(self) -> bool:
        return self.valid_loader is not None and self.config.eval_iters > 0

    def _lm_eval(self, final: bool = False) -> None:
        """--lm-eval-tasks every --lm-eval-interval iterations and after the last one."""
        if self.lm_eval is not None and self.lm_eval.due(self.state.iteration, final):
            self.lm_eval.run(self.model, self.state.iteration)

    def _should_exit(self, start_time: float) -> bool:
        config = self.config
        if config.exit_interval and self.state.iteration % config.exit_interval == 0:
            return True
        if config.exit_duration_in_mins is None and self.signal_handler is None:
            return False
        # Ranks must agree, or one would leave the collective of the next step alone.
        elapsed = (time.time() - start_time) / 60.0 if config.exit_duration_in_mins is not None else 0.0
        signalled = float(self.signal_handler is not None and self.signal_handler.received)
        flags = torch.tensor([elapsed, signalled], device=self.runtime.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] > 0:
            self.logger.print(f"> exit signal received: checkpointing at iteration {self.state.iteration} and exiting")
            return True
        return config.exit_duration_in_mins is not None and float(flags[0]) > config.exit_duration_in_mins

    def evaluate(self) -> float:
        """Validation loss over the first --eval-iters global batches of the validation set,
        with fixed corruption draws (keyed by validation sample index): --difflm-eval-mc-samples
        draws per row, their loss sums pooled over their normalizers (validation_stream)."""
        return self._validation_losses()[0]

    @torch.no_grad()
    def _validation_losses(self) -> Tuple[float, Dict[str, float]]:
        """`evaluate`'s loss and its named terms (loss_parts)."""
        self.model.eval()
        totals = None  # [normalizer, loss sum, part sums...] pooled over draws and batches
        for draw in range(self.config.difflm_eval_mc_samples):
            data_iterator = self.valid_loader()
            for step in range(self.config.eval_iters):
                first = step * self.config.global_batch_size
                batch_loss = self._forward_backward(data_iterator, False, 0, first, stream=validation_stream(draw))
                totals = batch_loss.totals.clone() if totals is None else totals + batch_loss.totals
        self.model.train()
        if totals is None:
            return 0.0, {}
        values = (totals[1:] / totals[0].clamp(min=1.0)).tolist()
        return values[0], dict(zip(self.loss_parts, values[1:]))

    def evaluate_and_log(self) -> float:
        with self.hooks.evaluation(self.state.iteration):
            loss, parts = self._validation_losses()
        if self.logger is not None:
            self.logger.on_validation(self.state, loss, parts)
        return loss


# ---------------------------------------------------------------------- building blocks
def replica_group(groups: ProcessGroups):
    """The ranks that hold the same weights and see other tokens: the data-parallel replicas, and
    with context parallelism their cp ranks too (gradients, ZeRO and FSDP2 shard over these)."""
    return groups.dp_cp if group_size(groups.cp) > 1 else groups.dp


def shard_groups(groups: ProcessGroups) -> tuple:
    """(dense, expert) groups the sharded state is split over: the replicas, or with
    --num-distributed-optimizer-instances the replicas of this rank's instance."""
    dense = groups.intra_dp_cp if groups.intra_dp_cp is not None else replica_group(groups)
    return dense, groups.intra_expert_dp if groups.intra_expert_dp is not None else groups.expert_dp


def build_data_loader(dataset, consumed_samples: int, config: TrainingConfig, runtime: Runtime,
                      layout: ParallelState) -> Iterator:
    """An iterator of this replica's micro-batches (tensor-parallel peers read the same ones),
    starting after `consumed_samples`."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, config.micro_batch_size,
                                         layout.dp_rank, layout.dp)
    # Starting an iterator draws a base seed (for the workers) from the loader's generator; without
    # one of its own it draws from the global torch RNG, which dropout uses: a resumed run (which
    # starts its iterator after restoring the RNG) or an evaluation would shift every later mask.
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=config.num_workers,
                                         pin_memory=runtime.device.type == "cuda",
                                         generator=torch.Generator().manual_seed(config.seed))
    return iter(loader)


def build_optimizer_and_scheduler(config: RunConfig, model: nn.Module, dp_group=None, expert_dp_group=None):
    """AdamW (ZeRO-1 over `dp_group` / `expert_dp_group` under the optim strategy) and its schedule."""
    strategy = config.parallel.sharding_strategy
    optimizer = build_optimizer(model, config.optimizer, optimizer_sharding_group(strategy, dp_group),
                                optimizer_sharding_group(strategy, expert_dp_group))
    scheduler = OptimizerParamScheduler(optimizer, **config.lr_schedule)
    return optimizer, scheduler


def dataset_sizes(config: TrainingConfig) -> List[int]:
    """Samples needed from the train, validation and test splits over the whole run."""
    evaluations = config.train_iters // config.eval_interval + 1
    eval_samples = config.eval_iters * config.global_batch_size
    train_samples = config.batch_schedule.samples_after(config.train_iters)  # the sum of a ramp's batches
    return [train_samples, eval_samples, eval_samples if evaluations else 0]


def build_model(config: RunConfig, runtime: Runtime, layout: ParallelState,
                model_provider: Callable) -> nn.Module:
    """This rank's model, initialised on the device: its pipeline stage, or under interleaving its
    chunks (ModelChunks), built with one shared ParallelContext."""
    pg = ParallelContext.build(layout.groups, config.model.sequence_parallel)
    virtual = config.parallel.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(virtual):
        kwargs = {}
        if layout.pp > 1:
            kwargs["layer_range"] = stage_layer_range(config.parallel.pipeline_layer_counts, layout.pp, layout.pp_rank,
                                                      vp_stage)
        first = layout.pp_rank == 0 and vp_stage == 0
        last = layout.pp_rank == layout.pp - 1 and vp_stage == virtual - 1
        with torch.device(runtime.device):  # no host-side init of billions of weights
            chunk = model_provider(config, pre_process=first, post_process=last, pg=pg, **kwargs)
        chunk = chunk.to(runtime.device)
        if config.torch_compile:  # before the data-parallel wrapper, which then hooks the compiled layers
            compile_transformer_layers(chunk, **training_compile_options(config.dlm))
        chunks.append(chunk)
    return chunks[0] if virtual == 1 else ModelChunks(chunks)


def wrap_replicas(run: RunConfig, model: nn.Module, runtime: Runtime, layout: ParallelState,
                  logger: TrainingLogger) -> tuple:
    """The data-parallel wrapper (with distributed-optimizer instances: sharded within one,
    replicated across them), the optimizer and its schedule."""
    groups, replicas = layout.groups, replica_group(layout.groups)
    config = run.parallel.data_parallel_config
    instances = None if groups.intra_dp_cp is None else (groups.intra_dp_cp, groups.inter_dp_cp)
    expert_instances = None if groups.intra_expert_dp is None else (groups.intra_expert_dp, groups.inter_expert_dp)
    model = wrap_data_parallel(model, runtime.device, replicas, pipeline=layout.pp > 1, expert_group=groups.expert_dp,
                               config=config, instances=instances, expert_instances=expert_instances)
    if group_size(replicas) > 1:
        logger.print(describe_data_parallel(config, group_size(replicas), layout.optimizer_instances, layout.pp > 1))
    optimizer, scheduler = build_optimizer_and_scheduler(run, model, *shard_groups(groups))
    return model, optimizer, scheduler


def attach_precision(config: RunConfig, model: nn.Module, optimizer, layout: ParallelState,
                     logger: TrainingLogger) -> Optional[WeightCopies]:
    """The precision converter (--cache-low-precision-weights' working copies, float8 ones under
    --fp8-format) applied to the wrapped model; the copies, or None."""
    precision = config.precision
    copies = apply_precision(model, precision, config.model.compute_dtype, optimizer,
                             (replica_group(layout.groups), layout.groups.tp))
    if copies is not None:
        logger.print(f"> {len(copies.pairs)} linear layers read working copies of their weights"
                     + (f", {copies.float8_layers} of them in float8" if precision.fp8_format else
                        f" in {str(copies.dtype).replace('torch.', '')}"))
    if precision.fp8_format:
        logger.print(f"> fp8: {copies.float8_layers} linear layers train in float8 ({precision.fp8_format}, "
                     f"{precision.fp8_recipe})")
        logger.count_fp8_peak()
    return copies


def build_trainer(config: RunConfig, runtime: Runtime, train_valid_test_datasets_provider: Callable,
                  model_provider: Callable, forward_step_func: ForwardStepFunc,
                  trainer_class: Callable[..., Trainer] = Trainer) -> Trainer:
    """Model, data-parallel wrapper, optimizer, schedule and data. The providers and the forward
    step receive `config` (the RunConfig), never the flags' Namespace. `trainer_class`: the loop
    (Trainer, or a subclass that makes its own batches: megatron/rl/trainer.py's RLTrainer)."""
    if not isinstance(config, RunConfig):
        raise TypeError(f"build_trainer takes a RunConfig (run_config.run_config(args)), not {type(config).__name__}")
    parallel, seed = config.parallel, config.training.seed
    set_random_seeds(seed)
    layout = initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                       parallel.context_parallel_size, parallel.expert_model_parallel_size,
                                       parallel.virtual_pipeline_model_parallel_size,
                                       parallel.expert_tensor_parallel_size,
                                       parallel.num_distributed_optimizer_instances)
    model = build_model(config, runtime, layout, model_provider)
    # The weights came from --seed on every stage (the same under any layout); dropout draws
    # from the stage's own seed, as in Megatron, or every stage would repeat the first one's masks.
    set_random_seeds(stage_seed(seed, layout.pp_rank))
    training = config.training
    logger = TrainingLogger(config.logging, training, config.record, runtime)
    logger.log_start(model, layout)
    model, optimizer, scheduler = wrap_replicas(config, model, runtime, layout, logger)
    copies = attach_precision(config, model, optimizer, layout, logger)
    train_ds, valid_ds, _ = train_valid_test_datasets_provider(config, dataset_sizes(training))
    # Variable-length DLM batches change the shapes stages exchange; fixed ones are announced once.
    links = layout.pipeline_links(runtime.device, variable_shapes=config.dlm.varilen_prob > 0)
    trainer = trainer_class(
        training, model, optimizer, scheduler, partial(forward_step_func, config=config),
        train_loader=lambda consumed: build_data_loader(train_ds, consumed, training, runtime, layout),
        valid_loader=None if valid_ds is None else (lambda: build_data_loader(valid_ds, 0, training, runtime, layout)),
        runtime=runtime, logger=logger, groups=layout.groups, links=links,
        hooks=LoopHooks.from_config(config, logger, runtime), rerun_config=config.rerun,
        loss_scale=config.precision.loss_scale, loss_parts=objective.loss_parts(config.dlm))
    trainer.weight_copies = copies
    trainer.lm_eval = build_in_loop_evaluation(config.lm_eval, model, config.data.tokenizer, runtime.device, logger)
    return trainer


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable,
             forward_step_func: ForwardStepFunc, extra_args_provider: Optional[ExtraArgsProvider] = None,
             argv: Optional[List[str]] = None, *, args: Optional[argparse.Namespace] = None,
             trainer_class: Callable[..., Trainer] = Trainer) -> Optional[Trainer]:
    """Parse flags, build everything, train. Flag problems exit with code 2 before any of it; bad
    data or a bad checkpoint found while building or training (InputError: an id outside the
    vocabulary, a damaged shard, a save that fails for lack of space) exits with code 1 and one line.
    With --check-args only the flags are validated (returns None). `args`: flags an entry point parsed
    itself (parse_args with its extra flags), instead of `argv`; `trainer_class` as build_trainer's."""
    if args is None:
        args = parse_args(argv, extra_args_provider)
    if args.check_args:
        return None
    config = run_config(args)  # from here on the typed configs travel, not the flags
    set_deterministic_mode(config.deterministic_mode)
    runtime = initialize_distributed(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    trainer = lock = None
    try:
        checkpoint, record = config.checkpoint, config.record
        lock = acquire_save_lock(checkpoint.save, runtime.device) if checkpoint.save else None
        if checkpoint.load:  # a checkpoint this run cannot load is found before anything is built
            check_loadable(checkpoint, record)
        trainer = build_trainer(config, runtime, train_valid_test_datasets_provider, model_provider, forward_step_func,
                                trainer_class)
        if checkpoint.load:
            if load_checkpoint(checkpoint, record, trainer, log=trainer.logger.print) is None:
                trainer.logger.print(f"> no checkpoint in {checkpoint.load}; starting from scratch")
        if checkpoint.save:
            trainer.checkpointer = Checkpointer(checkpoint, record, trainer.logger.print)
        if config.training.exit_signal_handler:
            trainer.signal_handler = ExitSignalHandler(getattr(signal, config.training.exit_signal))
        trainer.train()
    except InputError as error:  # the user's input, not our bug: no traceback
        _exit_on_input_error(error, trainer, runtime)
    except TrainingDiverged as error:  # every rank raises it at the same step
        trainer.logger.print(f"error: {error}")
        trainer.logger.close()
        sys.exit(1)
    trainer.logger.close()
    if lock is not None:
        lock.release()
    if runtime.owns_process_group:
        # Every rank reaches teardown together: destroying while a peer is still in a collective
        # can block, and exiting with live gloo threads can abort the process. (On an error,
        # torchrun stops the other ranks; no teardown is attempted then.)
        dist.barrier()
        dist.destroy_process_group()
    return trainer


def _exit_on_input_error(error: InputError, trainer: Optional[Trainer], runtime: Runtime) -> NoReturn:
    """One line `error: ...` on stderr and exit code 1. Every rank prints its line: in the common
    case all of them find the same problem (the flags, the checkpoint, a failed save), and a rank
    that alone finds one (an id outside the vocabulary in the samples it read) still says why it
    stops; the launcher (torchrun) then stops the others."""
    print(f"error: {user_message(error)}", file=sys.stderr, flush=True)
    if trainer is not None:
        trainer.logger.close()
    if runtime.owns_process_group and runtime.world_size == 1:  # no peer to wait for
        dist.destroy_process_group()
    sys.exit(1)
