"""The model chunks one rank holds: one stage, or v virtual stages under interleaving.

With interleaved 1F1B a rank holds v non-contiguous slices of the decoder (rank r of p holds
virtual stages r, r + p, ...). `ModelChunks` keeps them together as one module for the parts of
the loop that treat the rank's model as a whole (parameters, train/eval, the optimizer,
clipping, checkpoints), while the schedule runs each chunk by itself. Its checkpoint
description is the union of the chunks' (layers are keyed by global index, so the keys are
those of the one-stage model), never prefixed by a chunk number.
"""

from __future__ import annotations

from typing import Dict, List

from torch import nn


class ModelChunks(nn.Module):
    def __init__(self, chunks: List[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def sharded_state_dict(self, prefix: str = "") -> Dict:
        sharded = {}
        for chunk in self.chunks:
            sharded.update(getattr(chunk, "module", chunk).sharded_state_dict(prefix))
        return sharded

    @property
    def rng_tracker(self):
        """The chunks share one ParallelContext, so one tracker."""
        return getattr(getattr(self.chunks[0], "module", self.chunks[0]), "rng_tracker", None)

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelChunks is run chunk by chunk by the pipeline schedule, not called")


def model_chunks(model: nn.Module) -> List[nn.Module]:
    """The chunks of a rank's model: the model itself unless it is a ModelChunks."""
    return list(model.chunks) if isinstance(model, ModelChunks) else [model]
