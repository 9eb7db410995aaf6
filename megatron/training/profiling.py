"""--profile (the torch profiler over chosen steps) and --record-memory-history.

The trace covers the steps [--profile-step-start, --profile-step-end), a step being named by
the iteration count before it (Megatron's convention: `--profile-step-start 10` starts as the
11th step begins); each step is a `ProfilerStep#<iteration>` span. It goes to
`torch_profile/rank-<rank>.json.gz` beside --tensorboard-dir (as Megatron writes it), or in the
working directory without one, written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from megatron.training.configs import ProfilingConfig


def trace_dir(tensorboard_dir: Optional[str]) -> str:
    """Where --profile writes: a sibling of the tensorboard directory, or ./torch_profile."""
    if tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile")
    return os.path.abspath("torch_profile")


class StepProfiler:
    def __init__(self, config: ProfilingConfig, rank: int, device: torch.device, directory: str,
                 log: Callable[[str], None] = print) -> None:
        self.config, self.rank, self.device, self.directory, self.log = config, rank, device, directory, log
        self.enabled = config.profile and rank in config.profile_ranks
        self.profiler: Optional[torch.profiler.profile] = None
        self.path: Optional[str] = None

    def step_start(self, iteration: int) -> None:
        """Before the step that follows `iteration` completed steps."""
        if not self.enabled:
            return
        if self.profiler is not None:
            self.profiler.step()  # closes ProfilerStep#<previous>, opens ProfilerStep#<iteration>
        elif self.config.profile_step_start <= iteration < self.config.profile_step_end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # A schedule that always records: the profiler then marks every step with its number.
            self.profiler = torch.profiler.profile(activities=activities,
                                                   schedule=lambda step: torch.profiler.ProfilerAction.RECORD,
                                                   record_shapes=self.config.pytorch_profiler_collect_shapes,
                                                   with_stack=self.config.pytorch_profiler_collect_callstack,
                                                   acc_events=True)  # one cycle: keep all of it
            self.profiler.step_num = iteration
            self.profiler.start()

    def step_end(self, iteration: int) -> None:
        """After a step, `iteration` being the completed steps."""
        if self.profiler is not None and iteration >= self.config.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Ends the trace (also when training ends inside the window) and writes it."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank-{self.rank}.json.gz")
        temporary = os.path.join(self.directory, f".rank-{self.rank}.tmp.json.gz")  # .gz: torch compresses
        profiler.export_chrome_trace(temporary)
        os.replace(temporary, self.path)
        self.log(f"> profile of steps [{self.config.profile_step_start}, {self.config.profile_step_end}) "
                 f"written to {self.path}")


class MemoryHistory:
    """--record-memory-history: the CUDA caching allocator's history on the --profile-ranks,
    dumped as a snapshot (pytorch.org/memory_viz) at every --log-interval."""

    def __init__(self, config: ProfilingConfig, rank: int, device: torch.device,
                 log: Callable[[str], None] = print) -> None:
        self.enabled = config.record_memory_history and rank in config.profile_ranks
        if self.enabled and device.type != "cuda":
            log("> --record-memory-history: no CUDA device, so no allocator history on CPU")
            self.enabled = False
        base, extension = os.path.splitext(config.memory_snapshot_path)
        self.path = f"{base}_{rank}{extension}"

    def start(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=100000)

    def stop(self) -> None:
        if self.enabled:
            self.dump()
            torch.cuda.memory._record_memory_history(enabled=None)

    def dump(self) -> None:
        if not self.enabled:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        temporary = os.path.join(directory, "." + os.path.basename(self.path) + ".tmp")
        torch.cuda.memory._dump_snapshot(temporary)
        os.replace(temporary, self.path)
