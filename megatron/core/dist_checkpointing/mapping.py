"""How a local tensor maps onto a global, layout-independent checkpoint tensor.

Every module describes its parameters as `ShardedTensor`s: the checkpoint key, the local
data, the global shape and where the local piece sits in it. A checkpoint written under
one parallel layout can then be read under another by asking for different pieces of
the same global tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass
class ShardedTensor:
    key: str
    """Layout-independent checkpoint key (e.g. `decoder.layers.3.mlp.linear_fc1.weight`)."""
    data: torch.Tensor
    """The local piece held by this rank."""
    global_shape: Tuple[int, ...]
    """Shape of the full tensor across all ranks."""
    global_offset: Tuple[int, ...]
    """Index of `data[0, 0, ...]` inside the full tensor."""
    replica_id: int = 0
    """0 on the rank that writes this piece; other ranks holding a copy use other ids."""
    padded_rows: bool = False
    """Dim 0 carries layout-dependent padding (the vocabulary, padded to a multiple of tp):
    loading from a checkpoint with a different padding reads the rows both have."""

    @classmethod
    def from_local(cls, key: str, data: torch.Tensor) -> "ShardedTensor":
        """A tensor that is not split: its local data is the whole global tensor."""
        return cls(key, data, tuple(data.shape), (0,) * data.dim())

    def clipped_rows(self, stored_rows: int) -> "ShardedTensor | None":
        """This piece restricted to the first `stored_rows` rows of the global tensor."""
        rows = min(self.data.shape[0], stored_rows - self.global_offset[0])
        if rows <= 0:
            return None
        return ShardedTensor(self.key, self.data[:rows], (stored_rows, *self.global_shape[1:]),
                             self.global_offset, self.replica_id, self.padded_rows)

    def __post_init__(self) -> None:
        if len(self.global_shape) != self.data.dim() or len(self.global_offset) != self.data.dim():
            raise ValueError(f"ShardedTensor {self.key}: global_shape {self.global_shape} and offset "
                             f"{self.global_offset} must have one entry per dim of data {tuple(self.data.shape)}")
        for size, offset, total in zip(self.data.shape, self.global_offset, self.global_shape):
            if offset < 0 or offset + size > total:
                raise ValueError(f"ShardedTensor {self.key}: local shape {tuple(self.data.shape)} at offset "
                                 f"{self.global_offset} does not fit in global shape {self.global_shape}")
