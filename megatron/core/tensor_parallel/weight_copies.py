"""Low-precision working copies of the linear layers' fp32 weights (`--cache-low-precision-weights`).

Under bf16 autocast with fp32 master weights every forward of every micro-batch casts each
linear weight to bf16: a read of 4 and a write of 2 bytes a parameter (the compiler fuses the
cast into a neighbouring kernel, but the bytes stay), about 2 ms a step at the Qwen3-1.7B shape on
an H200. Megatron keeps bf16 parameters and fp32 main weights in the optimizer instead; here the
fp32 parameters stay (checkpoints, data-parallel buffers and the optimizer are unchanged) and each
tensor-parallel linear layer gets a non-persistent buffer `weight_low` in the compute dtype that
its training forward reads instead of casting (`fp32_weight_grad.linear`). The weight gradient
still reaches the fp32 weight, computed in fp32.

Freshness: `WeightCopies.refresh` (the trainer calls it before each iteration's forwards) re-casts
every copy that the optimizer did not write in the step since the last refresh, and every copy
whose weight changed after it was written (its version counter or storage moved: a loaded
checkpoint, a hand edit). A `CompiledAdamW` handed the copies writes them in its update kernel
(2 more bytes a parameter in a pass that already reads and writes the weight); any other
optimizer, and ZeRO-1's broadcast of the other ranks' shards (collectives do not move version
counters), leave them to the refresh, which then costs one cast a step instead of one per
micro-batch. Evaluation (`module.eval()`) always casts, so no copy is read outside training.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

BUFFER = "weight_low"


class WeightCopies:
    """The compute-dtype copies of `model`'s tensor-parallel linear weights (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        self.dtype = dtype
        self.layers: List[Tuple[nn.Module, torch.Tensor]] = []
        # An untied output layer's weight is read by the loss (linear_cross_entropy), not by the
        # layer's forward: a copy of it would never be read.
        heads = {id(getattr(module, "output_layer")) for module in model.modules() if hasattr(module, "output_layer")}
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and id(module) not in heads \
                    and weight is not None and weight.dtype == torch.float32:
                copy = torch.empty_like(weight, dtype=dtype)
                module.register_buffer(BUFFER, copy, persistent=False)  # not in checkpoints
                self.layers.append((module, copy))
        self._index: Dict[int, int] = {}
        self._written: Dict[int, tuple] = {}
        """Copies the optimizer wrote since the last refresh: index -> the weight's stamp then."""
        self.refresh()

    @property
    def pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(weight, copy) of every layer, the weight read live (a loader may assign a new parameter)."""
        return [(module.weight, copy) for module, copy in self.layers]

    @staticmethod
    def _stamp(weight: torch.Tensor) -> tuple:
        return id(weight), weight._version, weight.data_ptr()

    def refresh(self) -> int:
        """Re-cast every copy not written by the optimizer since the last refresh, or whose weight
        changed after it was; returns how many."""
        pairs = self.pairs
        stale = [index for index, (weight, _) in enumerate(pairs) if self._written.get(index) != self._stamp(weight)]
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([pairs[i][1] for i in stale], [pairs[i][0].detach() for i in stale])
        self._written.clear()
        self._index = {id(weight): index for index, (weight, _) in enumerate(pairs)}
        return len(stale)

    def copy_of(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The copy of `weight`, for an optimizer that writes it with the update; None if it has none."""
        index = self._index.get(id(weight))
        return None if index is None else self.layers[index][1]

    def written(self, weights: List[torch.Tensor]) -> None:
        """The optimizer wrote these weights' copies with their new values."""
        for weight in weights:
            index = self._index.get(id(weight))
            if index is not None:
                self._written[index] = self._stamp(weight)


def training_copy(module: nn.Module) -> Optional[torch.Tensor]:
    """The layer's copy to read in this forward: only in training mode, where `refresh` keeps it fresh."""
    return getattr(module, BUFFER, None) if module.training else None


def attach_weight_copies(model: nn.Module, optimizer, dtype: torch.dtype) -> WeightCopies:
    """Copies for `model`'s linear layers, written by each of this rank's `CompiledAdamW` steps (the
    other optimizers leave them to `refresh`). After the data-parallel wrapper: its buffers are not
    broadcast, and these need not be (every rank writes its own)."""
    from megatron.core.optimizer.compiled_adamw import CompiledAdamW
    from megatron.core.optimizer.optimizer import local_optimizers

    copies = WeightCopies(model, dtype)
    for local in local_optimizers(optimizer):
        if isinstance(local, CompiledAdamW):
            local.weight_copies = copies
    return copies
