"""How the micro-batches of one global batch run: the seam pipeline schedules plug into.

The contract every schedule keeps (Megatron's `forward_backward_func`):
- `forward_step(data_iterator, model, microbatch) -> (output, loss_func)` runs one micro-batch's
  forward; `loss_func(output) -> (loss_sum, normalizer)`: the sum of its weighted token losses
  and what that sum will be divided by (see distributed/loss_normalization.py);
- the loss exists on the last stage only (with one stage, everywhere); each micro-batch's
  `loss_sum` is backpropagated as it is (through `scale_loss`, fp16's loss scaling), never
  divided: the division happens once per global batch;
- gradients are synchronised over data-parallel replicas on the last micro-batch only;
- every micro-batch's values are added to the `GlobalBatchLoss` it is given, which the caller
  reduces once.
`forward_backward_no_pipelining` is the schedule of one pipeline stage; 1F1B and interleaved
1F1B will sit beside it, chosen by `get_forward_backward_func`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch
from torch import nn

from megatron.core.distributed.data_parallel import no_sync
from megatron.core.distributed.loss_normalization import GlobalBatchLoss

LossFunc = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
ForwardStep = Callable[[Iterator, nn.Module, int], Tuple[torch.Tensor, LossFunc]]


def forward_backward_no_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                   num_microbatches: int, loss: GlobalBatchLoss, forward_only: bool = False,
                                   scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                                   ) -> GlobalBatchLoss:
    """Forward (and, unless `forward_only`, backward) every micro-batch in turn on one stage."""
    for microbatch in range(num_microbatches):
        last = microbatch == num_microbatches - 1
        with no_sync(model, last_microbatch=last or forward_only):
            output, loss_func = forward_step(data_iterator, model, microbatch)
            loss_sum, normalizer = loss_func(output)
            if not forward_only:
                (scale_loss(loss_sum) if scale_loss is not None else loss_sum).backward()
        loss.add(loss_sum, normalizer)
    return loss


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None) -> Callable:
    """The schedule for this layout (Megatron's name for the choice)."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise ValueError(f"pipeline-model-parallel-size {pipeline_model_parallel_size}: no pipeline schedule in "
                     "this release; use 1")
