"""Delayed scaling for the float8 layers (`--fp8-recipe delayed`, Megatron's recipe under Transformer
Engine): a layer casts its input and its output gradient with scales taken from earlier iterations'
amaxes instead of this tensor's own, so the cast needs no reduction before it and the amax it records
is read in the same pass (one Triton kernel on CUDA: fused_float8_cast.py).

State, per float8 layer (its `float8_copy.Float8Gemm`), two
columns each (0: the input, e4m3; 1: the output gradient, the format's gradient dtype):
- `current` [2]: this iteration's running amax, which every micro-batch's forward (the input,
  `float8_matmul.raise_amax`) and backward (the output gradient) raises; the backward hands its amax
  out as the gradient of a leaf, `gradient_amax` [1], whose hook raises the running amax and drops the
  gradient (a compiled backward writing into the amax itself fails torch 2.11's saved-tensor version
  check, `float8_matmul._Float8Linear`);
- `history` [--fp8-amax-history-len, 2]: the amaxes of the last iterations, most recent first;
- `scales` [2]: what the casts multiply by: largest / amax / 2^--fp8-margin, amax being the most recent
  entry (`--fp8-amax-compute-algo most_recent`, Megatron's default) or the history's largest (`max`).

`DelayedScaling.update` runs once an iteration, after the optimizer step: it takes the largest amax over
its `groups` (the trainer's: the data-parallel replicas with their context-parallel ranks, then the
tensor-parallel ranks, Megatron's amax reduction group; one all-reduce of [layers, 2] each), so every
rank of a layer casts with the same scales, those of the whole tensor, and a checkpoint holds what
every such rank holds; then it pushes the amax into the history and recomputes the scales; a scale
whose amax is zero or not finite keeps its last value, and a skipped iteration (a non-finite loss or
norm) leaves the history alone. Micro-batches of one iteration share its scales.

The first iteration of a run has no history: its layers scale each tensor by its own amax (the
tensorwise recipe, and so the same values) while recording; the next ones read the scales (`ready`
turns on, which the compiled layers see once, as a recompilation). Transformer Engine starts from a
scale of 1 instead, which flushes small gradients to zero in e5m2 on the first step. Evaluation scales
by the current amax and records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.fusions import fused_float8_cast, fused_float8_swiglu
from megatron.core.fp8.float8_copy import Float8Gemm
from megatron.core.fp8.float8_matmul import FORWARD_DTYPE, GRADIENT_DTYPES, raise_amax
from megatron.core.tensor_parallel.utils import group_size

ALGORITHMS = ("most_recent", "max")


@dataclass(frozen=True)
class DelayedScalingConfig:
    """Megatron's delayed-scaling flags."""

    history_len: int = 1
    """--fp8-amax-history-len: iterations of amaxes kept."""
    algo: str = "most_recent"
    """--fp8-amax-compute-algo: the scale's amax is the most recent one or the history's largest."""
    margin: int = 0
    """--fp8-margin: the scale divided by 2^margin, headroom for amaxes that grow."""

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {self.history_len}: must be at least 1")
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--fp8-amax-compute-algo {self.algo!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin {self.margin}: must be 0 or more")


class DelayedScaling:
    """The amax histories and scales of `gemms` (the float8 layers' `Float8Gemm`s, whose layers are called
    `names` in checkpoints), one row each; every GEMM gets views of its row (`Float8Gemm.use_delayed_scaling`)
    and its output gradient's amax leaf."""

    def __init__(self, gemms: List[Float8Gemm], names: List[str], fp8_format: str, config: DelayedScalingConfig,
                 groups: Sequence[Optional[dist.ProcessGroup]] = ()) -> None:
        device = gemms[0].rows.device if gemms else torch.device("cpu")
        count = len(gemms)
        self.config, self.gemms, self.names = config, gemms, list(names)
        self.groups = [group for group in groups if group_size(group) > 1]
        self.current = torch.zeros(count, 2, device=device)
        self.history = torch.zeros(count, config.history_len, 2, device=device)
        self.scales = torch.ones(count, 2, device=device)
        fused_float8_cast.register_for(self.current)  # the one-pass casts, before a compiled layer traces them
        fused_float8_swiglu.register_for(self.current)
        self.largest = torch.tensor([torch.finfo(FORWARD_DTYPE).max, torch.finfo(GRADIENT_DTYPES[fp8_format]).max],
                                    dtype=torch.float64, device=device)
        for index, gemm in enumerate(gemms):
            gemm.use_delayed_scaling(self.scales[index], self.current[index],
                                     self._gradient_amax_leaf(self.current[index, 1:]))
        self._set_ready(False)

    @staticmethod
    def _gradient_amax_leaf(slot: torch.Tensor) -> torch.Tensor:
        """A [1] leaf whose gradient, once autograd has put it in `.grad`, raises `slot` and is dropped."""
        leaf = torch.zeros(1, device=slot.device, requires_grad=True)

        def raise_slot(tensor: torch.Tensor) -> None:
            with torch.no_grad():
                raise_amax(slot, tensor.grad)
            tensor.grad = None
        leaf.register_post_accumulate_grad_hook(raise_slot)
        return leaf

    @property
    def ready(self) -> bool:
        """Whether the scales come from a recorded iteration (else the layers scale by the current amax)."""
        return self._ready

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        for gemm in self.gemms:
            gemm.delayed_ready = ready  # a Python flag: compiled layers guard on it

    @torch.no_grad()
    def update(self, skipped: bool = False) -> None:
        """After an iteration's optimizer step: its amaxes (the largest over the groups) into the
        history and the scales from it; `skipped`: the iteration was dropped, its amaxes too."""
        if not self.gemms:
            return
        if skipped:
            self.current.zero_()
            return
        for group in self.groups:  # the largest over all of them: max over one group, then the next
            dist.all_reduce(self.current, op=dist.ReduceOp.MAX, group=group)
        latest = torch.where(self.current.isfinite(), self.current, torch.zeros_like(self.current))
        self.history.copy_(torch.cat([latest[:, None], self.history[:, :-1]], dim=1))
        amax = self.history[:, 0] if self.config.algo == "most_recent" else self.history.amax(dim=1)
        scales = (self.largest / amax.double().clamp(min=1e-12) / 2.0 ** self.config.margin).float()
        self.scales.copy_(torch.where(amax > 0, scales, self.scales))
        self.current.zero_()
        self._set_ready(True)

    def state_dict(self) -> Dict[str, object]:
        """The layers' names, histories and scales, for this rank's checkpoint file (tensors, a list of str)."""
        return {"layers": self.names, "history": self.history.cpu(), "scales": self.scales.cpu(),
                "ready": torch.tensor(self.ready)}

    def load_state_dict(self, state: Dict[str, object]) -> Optional[str]:
        """Restore `state_dict`'s tensors; None, or why they do not fit this run (it then starts afresh)."""
        if state["layers"] != self.names:
            return (f"the saved {len(state['layers'])} float8 layers are not this rank's {len(self.names)} "
                    "(another layout)")
        if tuple(state["history"].shape) != tuple(self.history.shape):
            return (f"their history is {state['history'].shape[1]} iterations long, this run's "
                    f"{self.config.history_len} (--fp8-amax-history-len)")
        self.history.copy_(state["history"])
        self.scales.copy_(state["scales"])
        self.current.zero_()
        self._set_ready(bool(state["ready"]))
        return None
