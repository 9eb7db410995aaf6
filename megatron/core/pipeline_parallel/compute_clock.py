"""How long a pipeline stage computes, so that its bubble can be measured (Megatron's level-2
timers `forward-compute` and `backward-compute`).

A pipeline schedule wraps each forward and each backward of a micro-batch in `span(name)`, after
the receive that feeds it has been waited for and before its result is sent. On CUDA a span is a
pair of events on the current stream, so nothing synchronises the host and the schedule runs as
it would untimed: the start event runs once the stream has waited for the received tensor, the end
event once the compute is done. Elsewhere (gloo on CPU, where a receive blocks the host) a span is
wall-clock time. `collect()` reads and clears the totals, after the step has synchronised the
device (the forward-backward timer does).

The stage's bubble is then 1 - (forward-compute + backward-compute) / forward-backward: the share
of the schedule the stage spends waiting for its neighbours (and on what it does besides
computing), to set against 1F1B's (p - 1) / (m * v + p - 1) for p stages, m micro-batches and v
virtual stages per rank.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, List, Tuple

import torch

NAMES = ("forward-compute", "backward-compute")


class ComputeClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: Dict[str, List[Tuple[object, object]]] = {name: [] for name in NAMES}

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def span(self, name: str):
        """Times the block as compute of kind `name` (one of NAMES)."""
        start = self._mark()
        try:
            yield
        finally:
            self._spans[name].append((start, self._mark()))

    def collect(self) -> Dict[str, float]:
        """Seconds of each kind since the last call (the device must have finished the spans)."""
        totals = {}
        for name, spans in self._spans.items():
            if self.device.type == "cuda":
                totals[name] = sum(start.elapsed_time(end) for start, end in spans) / 1e3
            else:
                totals[name] = sum(end - start for start, end in spans)
            spans.clear()
        return totals


def bubble_formula(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """1F1B's bubble fraction, (p - 1) / (m * v + p - 1)."""
    return (stages - 1) / (microbatches * virtual_stages + stages - 1)
