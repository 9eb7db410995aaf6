"""Named random-number streams for dropout under tensor parallelism.

Dropout on activations that are split across tp ranks (attention probabilities, the
MLP's inner activations) must draw *different* masks on each tp rank, or the shards
would share one mask pattern; dropout on replicated activations (residual stream, with
sequence parallelism off) must draw the *same* mask everywhere or the replicas diverge.
The default generator serves the replicated case (seed it identically on every tp rank);
a tracker holds extra named streams, seeded per tp rank, that code enters with `fork`.

The tracker is an object the model owns, not a module global, so several models (or
tests) can live in one process.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the stream used inside tensor-parallel regions."""

_MODEL_PARALLEL_SEED_OFFSET = 2718
"""Megatron's distance of the tp streams from their stage's seed (model_parallel_cuda_manual_seed)."""
_PIPELINE_SEED_STRIDE = 100
"""Megatron's distance between the seeds of consecutive pipeline stages (_set_random_seed)."""


def stage_seed(seed: int, pp_rank: int) -> int:
    """The dropout seed of pipeline stage `pp_rank` (Megatron's seed + 100 * pipeline rank): stages
    run the same shapes in the same order, so one seed would give every stage the same masks. The
    virtual chunks of a stage share its streams, which advance from one chunk to the next."""
    return seed + _PIPELINE_SEED_STRIDE * pp_rank


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """The seed of the stream used inside tp regions, from the stage's seed (`stage_seed`): distinct
    per tp rank, shared across data-parallel replicas that hold the same tp rank."""
    return seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank


class TensorParallelRNGTracker:
    """Named generator states that `fork(name)` swaps in for the default ones and back.

    CPU state is always tracked; CUDA state of the current device too when CUDA is
    available, so the same code draws the same masks on CPU-only CI and on GPUs.
    """

    def __init__(self) -> None:
        self._states: Dict[str, Dict[str, torch.Tensor]] = {}
        self._seeds: Dict[str, int] = {}

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`, without touching the default generators."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        for other, other_seed in self._seeds.items():
            if other_seed == seed:
                # Two streams with one seed would produce identical "independent" masks.
                raise ValueError(f"seed {seed} of RNG stream {name!r} is already used by {other!r}")
        states = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.Generator(device="cuda").manual_seed(seed).get_state()
        self._states[name] = states
        self._seeds[name] = seed

    def names(self) -> List[str]:
        return list(self._states)

    def get_states(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """A copy of every stream's state, for exact resume from a checkpoint."""
        return {name: {dev: state.clone() for dev, state in states.items()} for name, states in self._states.items()}

    def set_states(self, states: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Restore streams saved by `get_states` (their seeds are not known, so duplicates are not checked)."""
        self._states = {name: {dev: state.clone() for dev, state in per_device.items()}
                        for name, per_device in states.items()}
        self._seeds = {}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on stream `name`; the stream advances and the defaults are restored after."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (known: {self.names()}); "
                           f"call tracker.add({name!r}, model_parallel_seed(seed, tp_rank)) first")
        saved = self._swap_in(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._swap_in(saved)

    @staticmethod
    def _swap_in(states: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Install `states` as the default generator states and return the ones they replace."""
        previous = {"cpu": torch.get_rng_state()}
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            previous["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(states["cuda"])
        return previous


def model_parallel_rng_tracker(seed: int, tp_rank: int,
                               tracker: Optional[TensorParallelRNGTracker] = None) -> TensorParallelRNGTracker:
    """A tracker (new or given) with the tp-rank-specific `MODEL_PARALLEL_RNG` stream added."""
    tracker = tracker if tracker is not None else TensorParallelRNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed, tp_rank))
    return tracker


def checkpoint_with_tracker(function, tracker: Optional[TensorParallelRNGTracker], *args):
    """Activation checkpointing that also replays the tracker's streams on recompute.

    torch's checkpoint restores the default generators before recomputing; dropout drawn from
    a tracker stream (tensor-parallel regions) would otherwise get a new mask in backward. The
    recompute runs from the streams as they were at forward time and then puts back the
    streams of the present, which later micro-batches keep drawing from.
    """
    from torch.utils.checkpoint import checkpoint

    if tracker is None:
        return checkpoint(function, *args, use_reentrant=False)
    at_forward = tracker.get_states()
    calls = [0]

    def replaying(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return function(*inner)
        present = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            return function(*inner)
        finally:
            tracker.set_states(present)

    return checkpoint(replaying, *args, use_reentrant=False)
