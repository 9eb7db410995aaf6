"""The loss of a global batch, and the one place its normalizer is applied.

Every micro-batch backpropagates the *sum* of its weighted token losses, never a mean: a mean
per micro-batch would weigh a short (variable-length, padded) micro-batch like a full one, and
accumulation or data parallelism would then not equal one big batch. What the sum is divided by
is the batch's *normalizer*: valid tokens (LLaDA's B*L), masked tokens, or sequences, as
`--difflm-loss-normalizer` says (`diffusion.loss_weights`), and loss-mask tokens in AR mode.

`GlobalBatchLoss` owns the rest of the story:
1. `add(loss_sum, normalizer)` once per micro-batch (the schedule does it);
2. `reduce()` once per step: the sums and the normalizers over the data-parallel replicas
   (tensor-parallel peers hold the same values), then over the pipeline stages, of which only
   the last added anything (the others hold zeros), so every stage gets the same values for
   the scale, the skip decision and the log. Context parallelism will sum loss sums over
   dp x cp but normalizers over dp only: the groups are arguments, so layouts change a call,
   not this class;
3. `loss` for the log (and `part_losses`, the terms of a loss of several, each over the same
   normalizer: the joint AR + DLM objective's diffusion and next-token terms), and
   `gradient_scale(replicas)` for the gradients. DDP and FSDP2 average gradients over the
   replicas, so the summed gradients are multiplied by
   replicas / normalizer. That factor is never applied to the gradients here: it goes to
   `clip_grad_norm(scale=...)`, which folds it into the clipping factor, and with a fused AdamW
   (which multiplies by `1 / optimizer.grad_scale` as it reads each gradient, the hook torch's
   GradScaler uses) into the optimizer step itself, so no pass over the gradients is spent on
   it (`optimizer.scale_gradients`; `forget_gradient_scale` drops it after the step).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import group_size


class GlobalBatchLoss:
    """Running (sum of weighted token losses, normalizer) of one global batch, in float64; with
    `parts`, also the sums of the loss's named terms (they add up to the loss sum)."""

    def __init__(self, device: torch.device, parts: Tuple[str, ...] = ()) -> None:
        self.parts = tuple(parts)
        # [normalizer, loss sum, part sums...]: what sums over the loss group is one contiguous slice
        self.totals = torch.zeros(2 + len(self.parts), dtype=torch.float64, device=device)
        self.reduced = False

    def add(self, loss_sum: torch.Tensor, normalizer: torch.Tensor,
            part_sums: Optional[torch.Tensor] = None) -> None:
        """One micro-batch's values (detached: the backward already has the loss); `part_sums`, one
        per part, is required exactly when the loss has parts."""
        if (part_sums is None) != (not self.parts) or (part_sums is not None and part_sums.numel() != len(self.parts)):
            raise ValueError(f"GlobalBatchLoss of parts {self.parts} needs one sum per part, got {part_sums}")
        values = [normalizer.detach().double().reshape(1), loss_sum.detach().double().reshape(1)]
        if part_sums is not None:
            values.append(part_sums.detach().double().reshape(-1))
        self.totals += torch.cat(values)

    def reduce(self, loss_group: Optional[dist.ProcessGroup] = None,
               normalizer_group: Optional[dist.ProcessGroup] = None,
               pipeline_group: Optional[dist.ProcessGroup] = None) -> "GlobalBatchLoss":
        """Sum over the replicas that saw other samples (one all-reduce when the groups agree),
        then over `pipeline_group` (the last stage's values to every stage)."""
        normalizer_group = loss_group if normalizer_group is None else normalizer_group
        if normalizer_group is loss_group:
            if group_size(loss_group) > 1:
                dist.all_reduce(self.totals, group=loss_group)
        else:
            for values, group in ((self.totals[1:], loss_group), (self.totals[:1], normalizer_group)):
                if group_size(group) > 1:
                    dist.all_reduce(values, group=group)
        if group_size(pipeline_group) > 1:
            dist.all_reduce(self.totals, group=pipeline_group)
        self.reduced = True
        return self

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.totals[1]

    @property
    def normalizer(self) -> torch.Tensor:
        return self.totals[0]

    @property
    def part_sums(self) -> torch.Tensor:
        """[len(parts)] float64: each part's summed weighted token losses."""
        return self.totals[2:]

    @property
    def part_losses(self) -> torch.Tensor:
        """[len(parts)]: each part's sum / the normalizer (they add up to `loss`)."""
        return self.totals[2:] / self.totals[0].clamp(min=1.0)

    @property
    def loss(self) -> torch.Tensor:
        """The batch's loss: sum / normalizer (an empty batch counts as normalizer 1)."""
        return self.totals[1] / self.totals[0].clamp(min=1.0)

    def gradient_scale(self, replicas: int) -> torch.Tensor:
        """The factor that turns the (replica-averaged) summed gradients into gradients of `loss`."""
        if not self.reduced:
            raise RuntimeError("GlobalBatchLoss.gradient_scale before reduce(): the normalizer is partial")
        return replicas / self.totals[0].float().clamp(min=1.0)
