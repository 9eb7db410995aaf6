"""Per-phase wall-clock timers of the training step (--timing-log-level, --timing-log-option).

Megatron's names and levels: level 1 times forward-backward, all-grads-sync and optimizer once
per step, level 2 also every batch fetch (batch-generator, which forward-backward contains) and,
under pipeline parallelism, the stage's forward-compute and backward-compute within forward-backward
(a ComputeClock the schedule fills, megatron/core/pipeline_parallel/compute_clock.py), from which
the report derives the stage's measured pipeline bubble.
The loop marks phase boundaries (`step_start`, `lap`); at each --log-interval the logger
gathers every rank's totals (one all-gather) and reports seconds per step. Each boundary
synchronises the device, which is why timing is off (level 0) unless asked for.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.compute_clock import ComputeClock

# Every timer and its level, in the order reports list them; ranks gather them in this order.
TIMER_LEVELS = {"forward-backward": 1, "forward-compute": 2, "backward-compute": 2, "all-grads-sync": 1,
                "optimizer": 1, "batch-generator": 2}


class Timers:
    def __init__(self, level: int = 0, option: str = "minmax", device: Optional[torch.device] = None) -> None:
        self.level, self.option = level, option
        self.device = device or torch.device("cpu")
        self.totals: Dict[str, float] = {}
        self._last: Optional[float] = None
        self._clock: Optional[ComputeClock] = None

    def names(self) -> List[str]:
        return [name for name, level in TIMER_LEVELS.items() if level <= self.level]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def step_start(self) -> None:
        """The start of the first phase of a step."""
        if self.level >= 1:
            self._last = self._now()

    def lap(self, name: str) -> None:
        """Phase `name` ends now: it began at the previous boundary."""
        if TIMER_LEVELS.get(name, 3) <= self.level and self._last is not None:
            now = self._now()
            self.add(name, now - self._last)
            self._last = now
            if name == "forward-backward" and self._clock is not None:  # the device is synchronised
                for part, seconds in self._clock.collect().items():
                    self.add(part, seconds)

    def compute_clock(self) -> Optional[ComputeClock]:
        """At level 2, the clock a pipeline schedule times its compute with (read at forward-backward's
        lap); None below it."""
        if self.level < 2:
            return None
        if self._clock is None:
            self._clock = ComputeClock(self.device)
        return self._clock

    @contextmanager
    def timed(self, name: str):
        """Times a block whatever the level (evaluation, checkpoint saves: once in a while)."""
        start = self._now()
        try:
            yield
        finally:
            self.add(name, self._now() - start)

    def pop(self, name: str) -> Optional[float]:
        return self.totals.pop(name, None)

    def timed_iterator(self, iterator: Iterator) -> Iterator:
        """`iterator`, with each next() counted as batch-generator time at level 2."""
        return _TimedIterator(iterator, self) if self.level >= 2 else iterator

    def gather(self) -> Dict[str, List[float]]:
        """Every rank's totals of this level's timers since the last call (a collective over all
        ranks when distributed); timers no rank ran are left out. Resets the totals."""
        names = self.names()
        mine = torch.tensor([self.totals.pop(name, 0.0) for name in names], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            parts = [torch.empty_like(mine, device=on) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, mine.to(on))
            ranks = torch.stack([part.cpu() for part in parts])
        else:
            ranks = mine[None]
        return {name: ranks[:, i].tolist() for i, name in enumerate(names) if ranks[:, i].max() > 0}

    def report(self, gathered: Dict[str, List[float]], steps: int) -> Optional[str]:
        """The console block in Megatron's layout: milliseconds per step."""
        if not gathered:
            return None
        scale = 1000.0 / max(steps, 1)
        if self.option == "all":
            lines = ["times across ranks (ms):"]
            for name, times in gathered.items():
                lines.append(f"  {name}:")
                lines += [f"     rank {rank:2d}: {t * scale:.2f}" for rank, t in enumerate(times) if t > 0]
        else:
            lines = ["max time across ranks (ms):" if self.option == "max" else
                     "(min, max) time across ranks (ms):"]
            for name, times in gathered.items():
                ran = [t * scale for t in times if t > 0]
                value = f"{max(ran):.2f}" if self.option == "max" else f"({min(ran):.2f}, {max(ran):.2f})"
                lines.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
        bubbles = pipeline_bubbles(gathered)
        if bubbles:  # the schedule's share spent waiting (and not computing), per stage
            lines.append(f"pipeline bubble (1 - compute / forward-backward): min {100 * min(bubbles):.1f}%, "
                         f"mean {100 * sum(bubbles) / len(bubbles):.1f}%, max {100 * max(bubbles):.1f}% over "
                         f"{len(bubbles)} ranks")
        return "\n".join(lines)


def pipeline_bubbles(gathered: Dict[str, List[float]]) -> List[float]:
    """Each rank's measured bubble, 1 - (forward-compute + backward-compute) / forward-backward, for the
    ranks that timed their compute (pipeline stages at level 2); empty otherwise."""
    if "forward-compute" not in gathered or "forward-backward" not in gathered:
        return []
    backward = gathered.get("backward-compute", [0.0] * len(gathered["forward-compute"]))
    return [1.0 - (forward + back) / total for forward, back, total
            in zip(gathered["forward-compute"], backward, gathered["forward-backward"]) if forward > 0 and total > 0]


class _TimedIterator:
    def __init__(self, iterator: Iterator, timers: Timers) -> None:
        self.iterator, self.timers = iterator, timers

    def __iter__(self):
        return self

    def __next__(self):
        start = self.timers._now()
        try:
            return next(self.iterator)
        finally:
            self.timers.add("batch-generator", self.timers._now() - start)
