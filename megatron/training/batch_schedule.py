"""The global batch size as a function of consumed samples (Megatron's micro-batch calculators).

Two schedules exist in Megatron-LM and both are kept, with its rules:

* `--rampup-batch-size START INCR SAMPLES` (RampupBatchsizeNumMicroBatchesCalculator): the batch
  grows from START to --global-batch-size in (global - START) / INCR equal increments, the k-th
  applying once k * SAMPLES / increments samples are consumed; past SAMPLES it is the global one.
* `--step-batch-size-schedule "0:16 2.4B:320 ..."` (StepBatchsizeNumMicroBatchesCalculator):
  THRESHOLD:SIZE pairs, thresholds in tokens (divided by --seq-length into samples), K/M/B/T
  suffixes; the size of the largest threshold reached applies.

The batch of a step is read from the samples consumed before it, so a resumed run (whose
TrainState holds the consumed samples) continues at the same point of the schedule. Everything
here is a pure function of the consumed samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _parse_count(text: str, entry: str) -> int:
    """`2.4B` -> 2400000000: a number with an optional K/M/B/T suffix (any case), as Megatron reads it."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if multiplier != 1:
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: {text!r} is not a number "
                         "(optionally with a K, M, B or T suffix)") from None
    if not math.isfinite(number):
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: {text!r} is not finite")
    return int(number * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> List[Tuple[int, int]]:
    """(threshold in samples, global batch size) pairs, sorted, from `"0:768 250B:1536"`.

    Thresholds are tokens and become samples by integer division by `seq_length` (Megatron passes
    --seq-length, which pretraining always has). Entries are separated by spaces or commas.
    """
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError("--step-batch-size-schedule is empty; give THRESHOLD:SIZE pairs such as \"0:16 1B:32\"")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:SIZE (e.g. 2.4B:320)")
        threshold, size = entry.split(":", 1)
        schedule.append((_parse_count(threshold, entry) // seq_length, _parse_count(size, entry)))
    schedule.sort()
    if schedule[0][0] != 0:
        raise ValueError(f"--step-batch-size-schedule must start at threshold 0 (its first reaches "
                         f"{schedule[0][0]} samples); add a 0:SIZE entry")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"--step-batch-size-schedule thresholds must differ by at least one sample "
                             f"(--seq-length tokens): two reach {after} samples; merge or space them")
    for earlier, later in zip(schedule, schedule[1:]):
        if later[1] < earlier[1]:
            raise ValueError(f"--step-batch-size-schedule shrinks the batch from {earlier[1]} to {later[1]}; "
                             "Megatron's schedule only grows it")
    if schedule[0][1] < 1:
        raise ValueError(f"--step-batch-size-schedule sizes must be >= 1 (got {schedule[0][1]})")
    return schedule


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size at a consumed-samples count: constant, a linear ramp, or steps."""

    final: int
    """The batch size after the schedule (--global-batch-size; the last step of a step schedule)."""
    rampup: Optional[Tuple[int, int, int]] = None
    """(start, increment, ramp-up samples) of --rampup-batch-size."""
    steps: Tuple[Tuple[int, int], ...] = ()
    """(threshold in samples, size) pairs of --step-batch-size-schedule, sorted."""

    @classmethod
    def from_flags(cls, global_batch_size: int, rampup_batch_size: Optional[Sequence[int]] = None,
                   step_batch_size_schedule: Optional[str] = None, seq_length: int = 1) -> "BatchSchedule":
        if step_batch_size_schedule is not None:
            steps = tuple(parse_step_schedule(step_batch_size_schedule, seq_length))
            return cls(final=steps[-1][1], steps=steps)
        if rampup_batch_size is not None:
            return cls(final=global_batch_size, rampup=tuple(int(v) for v in rampup_batch_size))
        return cls(final=global_batch_size)

    def __post_init__(self) -> None:
        if self.rampup is None:
            return
        start, increment, samples = self.rampup
        if start < 1 or increment < 1 or samples < 1:
            raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: the start size, increment and "
                             "ramp-up samples must all be >= 1")
        if start >= self.final or (self.final - start) % increment:
            raise ValueError(f"--rampup-batch-size {start} {increment} {samples} cannot reach --global-batch-size "
                             f"{self.final}: the start must be smaller and (global - start) a multiple of the "
                             "increment")

    @property
    def varies(self) -> bool:
        return self.rampup is not None or len(self.steps) > 1

    def at(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after `consumed_samples`."""
        if self.steps:
            return [size for threshold, size in self.steps if threshold <= consumed_samples][-1]
        if self.rampup is None:
            return self.final
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.final
        # Megatron's float arithmetic, kept so each increment applies at the same step as there.
        per_increment = samples / ((self.final - start) // increment)
        return start + int(consumed_samples / per_increment) * increment

    def sizes(self) -> List[int]:
        """Every size the schedule can give, in order."""
        if self.steps:
            return [size for _, size in self.steps]
        if self.rampup is None:
            return [self.final]
        start, increment, _ = self.rampup
        return list(range(start, self.final + 1, increment))

    def _next_change(self, consumed_samples: int) -> Optional[int]:
        """A sample count > consumed_samples before which the size cannot change (None: never again).
        Ramps are walked step by step: their change points are defined in floating point."""
        if self.rampup is not None:
            return consumed_samples + 1 if consumed_samples <= self.rampup[2] else None
        later = [threshold for threshold, _ in self.steps if threshold > consumed_samples]
        return later[0] if later else None

    def samples_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Samples consumed after `iterations` more steps (from `consumed_samples`)."""
        while iterations > 0:
            size, change = self.at(consumed_samples), self._next_change(consumed_samples)
            steps = iterations if change is None else min(iterations, -(-(change - consumed_samples) // size))
            consumed_samples += steps * size
            iterations -= steps
        return consumed_samples

    def iterations_for(self, train_samples: int) -> int:
        """Steps of a `--train-samples` run, by Megatron's `update_train_iters` rules."""
        if self.steps:  # steps while fewer than train_samples are consumed (the last may overshoot)
            iterations = consumed = 0
            while consumed < train_samples:
                size, change = self.at(consumed), self._next_change(consumed)
                target = train_samples if change is None else min(change, train_samples)
                steps = -(-(target - consumed) // size)
                consumed, iterations = consumed + steps * size, iterations + steps
            return iterations
        if self.rampup is None:
            return train_samples // self.final
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:  # the ramp, as Megatron counts it
            consumed, iterations = consumed + self.at(consumed), iterations + 1
        # Then whole global batches; a partial last one is dropped.
        return iterations + max(train_samples - consumed, 0) // self.final
