"""--log-progress: Megatron-LM's progress.txt in the --save directory.

One tab-separated line per event, in Megatron's layout so its tools read ours:
`<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<event>[\\t<field>: <value>...]`, the
events being `Starting job` (when training starts) and, at every save, `Saved checkpoint` (or
`Saving async checkpoint`) with the iteration, this job's and the cumulative throughput
(TFLOP/s/GPU since the first job of this world size that the file records), the floating-point
operations and tokens so far, and the consumed samples. Only rank 0 writes; each write replaces
the file with a complete copy (temporary name, fsync, rename), so a crash leaves every line whole.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Optional, Tuple

FILENAME = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    def __init__(self, save_dir: str, world_size: int, flops_per_sample: float, is_main: bool = True) -> None:
        self.path = os.path.join(save_dir, FILENAME)
        self.world_size, self.flops_per_sample, self.is_main = world_size, flops_per_sample, is_main
        self.job_start: Optional[float] = None
        self.job_start_flops = 0.0

    def start(self, consumed_samples: int) -> None:
        self.job_start, self.job_start_flops = time.time(), self.flops_per_sample * consumed_samples
        self._append("Starting job")

    def saved(self, iteration: int, consumed_samples: int, consumed_tokens: int, asynchronous: bool) -> None:
        flops = self.flops_per_sample * consumed_samples
        job_seconds = max(time.time() - (self.job_start or time.time()), 1e-3)
        job = (flops - self.job_start_flops) / (job_seconds * 1e12 * self.world_size)
        started, flops_then = self._first_start()
        elapsed = max((datetime.now() - started).total_seconds(), 1e-3) if started else job_seconds
        cumulative = (flops - (flops_then if started else self.job_start_flops)) / (elapsed * 1e12 * self.world_size)
        event = "Saving async checkpoint" if asynchronous else "Saved checkpoint"
        self._append(f"{event}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                     f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                     f"Floating-point operations: {flops:.2e}\tTokens (in billions): {consumed_tokens / 1e9:.2f}\t"
                     f"Consumed samples: {consumed_samples}")

    def _read(self) -> str:
        try:
            with open(self.path) as handle:
                return handle.read()
        except FileNotFoundError:
            return ""

    def _append(self, event: str) -> None:
        if not self.is_main:
            return
        line = (f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                f"# GPUs: {self.world_size}\t{event}\n")
        text = self._read()
        if text and not text.endswith("\n"):  # a line torn by an older writer stays on its own
            text += "\n"
        temporary = self.path + ".tmp"
        with open(temporary, "w") as handle:
            handle.write(text + line)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)

    def _first_start(self) -> Tuple[Optional[datetime], float]:
        """When the earliest job of the latest unbroken run of this world size started, and the
        floating-point operations of the last save before it (Megatron's cumulative baseline)."""
        started, flops_then, last_saved = None, 0.0, 0.0
        for line in self._read().splitlines():
            fields = line.split("\t")
            try:
                world_size = int(fields[2].split(": ")[1])
                if fields[3] in ("Saved checkpoint", "Saving async checkpoint"):
                    last_saved = float(fields[7].split(": ")[1])
            except (IndexError, ValueError):
                continue
            if world_size != self.world_size:
                started = None
            elif fields[3] == "Starting job" and started is None:
                try:
                    started, flops_then = datetime.strptime(fields[0], _TIME_FORMAT), last_saved
                except ValueError:
                    continue
        return started, flops_then
