"""What the training loop does around its steps, evaluations and saves, beyond training:
phase timers, --profile, --record-memory-history, --manual-gc, --empty-unused-memory-level and
--log-progress. The Trainer calls one method per point of the loop; a default `LoopHooks()`
does nothing, so a Trainer built by hand trains as before.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from megatron.training.configs import ProfilingConfig, TrainingConfig
from megatron.training.profiling import MemoryHistory, StepProfiler, trace_dir
from megatron.training.progress_log import ProgressLog
from megatron.training.timers import Timers

if TYPE_CHECKING:
    from megatron.training.run_config import RunConfig


class LoopHooks:
    def __init__(self, training: Optional[TrainingConfig] = None, profiling: Optional[ProfilingConfig] = None,
                 device: Optional[torch.device] = None, rank: int = 0, timers: Optional[Timers] = None,
                 progress: Optional[ProgressLog] = None, logger=None, log_interval: int = 100,
                 trace_directory: Optional[str] = None) -> None:
        self.training = training or TrainingConfig()
        profiling = profiling or ProfilingConfig()
        self.device = device or torch.device("cpu")
        self.timers = timers or Timers(device=self.device)
        self.progress, self.logger, self.log_interval = progress, logger, log_interval
        self.log = logger.print if logger is not None else (lambda message: None)
        self.profiler = StepProfiler(profiling, rank, self.device, trace_directory or trace_dir(None), self.log)
        self.memory_history = MemoryHistory(profiling, rank, self.device, self.log)
        self.empties_cache = self.training.empty_unused_memory_level > 0 and self.device.type == "cuda"
        self._gc_was_enabled = gc.isenabled()

    @classmethod
    def from_config(cls, config: RunConfig, logger, runtime) -> "LoopHooks":
        logging, training = config.logging, config.training
        progress = None
        if logging.log_progress:
            flops_per_sample = logger.flops_per_iteration / training.global_batch_size
            progress = ProgressLog(config.checkpoint.save, config.parallel.world_size, flops_per_sample,
                                   runtime.is_main)
        return cls(training, config.profiling, runtime.device, runtime.rank, logger.timers, progress,
                   logger, logging.log_interval, trace_dir(logging.tensorboard_dir))

    # ------------------------------------------------------------------ the loop's points
    def train_start(self, state, train_iters: int) -> None:
        training = self.training
        if training.empty_unused_memory_level and not self.empties_cache:
            self.log(f"> --empty-unused-memory-level {training.empty_unused_memory_level}: no CUDA cache on CPU; "
                     "nothing to empty")
        start, end = self.profiler.config.profile_step_start, self.profiler.config.profile_step_end
        if self.profiler.enabled and (end <= state.iteration or start >= train_iters):
            self.log(f"> --profile: steps [{start}, {end}) are not run (iterations {state.iteration} to "
                     f"{train_iters}); no trace")
        if training.manual_gc:
            # Collections at the same steps on every rank: no rank stalls the others alone.
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        self.memory_history.start()
        if self.progress is not None:
            self.progress.start(state.consumed_train_samples)

    def data(self, iterator: Iterator) -> Iterator:
        return self.timers.timed_iterator(iterator)

    def step_start(self, iteration: int) -> None:
        self.profiler.step_start(iteration)
        self.timers.step_start()

    def phase_end(self, name: str) -> None:
        """A phase of the train step ended: forward-backward, all-grads-sync or optimizer."""
        self.timers.lap(name)
        level = self.training.empty_unused_memory_level
        if self.empties_cache and (name == "forward-backward" or (name == "optimizer" and level >= 2)):
            torch.cuda.empty_cache()

    def step_end(self, iteration: int) -> None:
        self.profiler.step_end(iteration)
        if iteration % self.log_interval == 0:
            self.memory_history.dump()
        training = self.training
        if training.manual_gc and training.manual_gc_interval and iteration % training.manual_gc_interval == 0:
            gc.collect()

    @contextmanager
    def evaluation(self, iteration: int):
        collects = self.training.manual_gc and self.training.manual_gc_eval
        if collects:
            gc.collect()
        with self.timers.timed("evaluate"):
            yield
        if collects:
            gc.collect(generation=0)  # what the evaluation itself left behind
        if self.empties_cache:
            torch.cuda.empty_cache()
        self._record_time("evaluate", iteration)

    def save(self, trainer) -> None:
        """A checkpoint save of the loop (timed; a progress line after it)."""
        with self.timers.timed("save-checkpoint"):
            trainer.checkpointer.save(trainer)
        state = trainer.state
        self._record_time("save-checkpoint", state.iteration)
        if self.progress is not None:
            self.progress.saved(state.iteration, state.consumed_train_samples, state.consumed_train_tokens,
                                asynchronous=trainer.checkpointer.pending is not None)

    def train_end(self) -> None:
        self.profiler.stop()
        self.memory_history.stop()
        if self.training.manual_gc and self._gc_was_enabled:
            gc.enable()

    def _record_time(self, name: str, iteration: int) -> None:
        seconds = self.timers.pop(name)
        if self.logger is not None and seconds is not None:
            self.logger.on_timer(name, seconds, iteration)
