"""A linear layer's GEMM reading a working copy of its weight in the compute dtype
(`--cache-low-precision-weights`; weight_copies.py makes the copies and keeps them fresh).

The precision converter (apply.py) replaces a layer's `LinearGemm` (tensor_parallel/fp32_weight_grad.py)
with a `CopyGemm` holding the copy as a non-persistent buffer (so it moves with the layer and stays out
of checkpoints). A training forward reads the copy instead of casting the fp32 weight; evaluation casts,
since the copies are refreshed for training iterations only. Under `--fp8-format` the decoder's layers
get float8 copies instead (fp8/float8_copy.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.tensor_parallel.fp32_weight_grad import LinearGemm, linear

__all__ = ["CopyGemm"]


class CopyGemm(LinearGemm):
    """`LinearGemm` reading `copy` (the weight in the compute dtype) in training."""

    def __init__(self, copy: torch.Tensor, fp32_weight_grad: bool = True) -> None:
        super().__init__(fp32_weight_grad)
        self.register_buffer("copy", copy, persistent=False)  # not in checkpoints

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                grad_into: Optional[torch.Tensor]) -> torch.Tensor:
        return linear(x, weight, bias, self.fp32_weight_grad, self.working_copy(), grad_into)

    def working_copy(self) -> Optional[torch.Tensor]:
        return self.copy if self.training else None
