"""AdamW with Megatron's parameter groups, and the gradient clipping of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.optimizer.compiled_adamw import CompiledAdamW
from megatron.core.tensor_parallel.utils import local_tensor


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    """Peak learning rate (the scheduler writes the current one into the groups)."""
    weight_decay: float = 0.01
    """Decoupled weight decay for matrices and embeddings; norms and biases get none."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global L2 norm clip; 0 disables clipping (the norm is still computed and logged)."""
    decoupled_lr: Optional[float] = None
    """Peak lr of the input embedding and the output layer (--decoupled-lr); None: `lr`."""
    decoupled_min_lr: Optional[float] = None
    """Their lr floor (--decoupled-min-lr); None: the scheduler's --min-lr."""
    compiled_step: bool = False
    """--compile-optimizer-step: `CompiledAdamW` (one compiled kernel per parameter) instead of the fused step."""
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Storage of Adam's moments (Megatron's precision-aware optimizer, --exp-avg-dtype / --exp-avg-sq-dtype):
    bf16 stores them rounded, the update computes in fp32; it takes `CompiledAdamW`."""

    @property
    def precision_aware(self) -> bool:
        return (self.exp_avg_dtype, self.exp_avg_sq_dtype) != (torch.float32, torch.float32)


# Megatron's `is_embedding_or_output_parameter` weights, by name (wrappers and FSDP2 keep names,
# not attributes): the word embedding (also the output weight when tied, on every stage that
# holds a copy) and the untied output layer.
DECOUPLED_LR_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    return any(name == suffix or name.endswith("." + suffix) for suffix in DECOUPLED_LR_PARAMETERS)


def param_groups(model: nn.Module, weight_decay: float, decoupled_lr: Optional[float] = None,
                 decoupled_min_lr: Optional[float] = None) -> List[Dict]:
    """Decayed weights, and norms/biases without decay (1-D parameters); with `decoupled_lr`, the
    embedding and output layer in a third group whose "max_lr" / "min_lr" the scheduler reads."""
    decay, no_decay, decoupled = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dim() == 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            (decoupled if decoupled_lr is not None and is_embedding_or_output(name) else decay).append(param)
    # wd_mult tells the LR scheduler, which rewrites weight decay every step, to keep it 0 here.
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    if decoupled:
        own = {"max_lr": decoupled_lr, **({} if decoupled_min_lr is None else {"min_lr": decoupled_min_lr})}
        groups.append({"params": decoupled, "weight_decay": weight_decay, "wd_mult": 1.0, **own})
    return [group for group in groups if group["params"]]


class ChainedOptimizer:
    """Several optimizers stepping as one (Megatron's ChainedOptimizer): under ZeRO-1 with MoE,
    the dense weights' state is split over the data-parallel replicas and the experts' over the
    expert-data-parallel ones. `param_groups` are the parts' own groups, so the LR scheduler and
    fp16's GradScaler drive every part."""

    def __init__(self, parts: List[torch.optim.Optimizer]) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> List[Dict]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> Dict:
        return {param: state for part in local_optimizers(self) for param, state in part.state.items()}

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def local_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The AdamW objects holding this rank's state: the parts of a ChainedOptimizer, ZeRO-1's local one."""
    parts = optimizer.parts if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [getattr(part, "optim", part) for part in parts]


def _adamw(groups: List[Dict], config: OptimizerConfig, zero_group: Optional[dist.ProcessGroup]):
    params = [p for group in groups for p in group["params"]]
    # The fused kernel updates every parameter in one launch on GPU; foreach elsewhere
    # (and for FSDP2's sharded DTensor weights).
    fused = all(p.is_cuda for p in params) and not any(hasattr(p, "to_local") for p in params)
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay, fused=True if fused else None)
    kind = torch.optim.AdamW
    if config.precision_aware:
        if any(hasattr(p, "to_local") for p in params):
            raise ValueError("--exp-avg-dtype / --exp-avg-sq-dtype bf16 are not supported with FSDP2's sharded "
                             "weights yet; use --data-parallel-sharding-strategy optim or fp32 moments")
        kind = CompiledAdamW
        kwargs.update(exp_avg_dtype=config.exp_avg_dtype, exp_avg_sq_dtype=config.exp_avg_sq_dtype)
    elif config.compiled_step and not any(hasattr(p, "to_local") for p in params):
        kind = CompiledAdamW
    if zero_group is None:
        return kind(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=kind, process_group=zero_group, **kwargs)


def build_optimizer(model: nn.Module, config: OptimizerConfig, zero_group: Optional[dist.ProcessGroup] = None,
                    expert_zero_group: Optional[dist.ProcessGroup] = None):
    """AdamW; with `zero_group`, ZeRO-1: each rank keeps the state of its share of the weights.
    Expert weights (MoE) differ between the data-parallel ranks under expert parallelism, so
    under ZeRO-1 they get an optimizer of their own, sharded over `expert_zero_group`."""
    groups = param_groups(model, config.weight_decay, config.decoupled_lr, config.decoupled_min_lr)
    experts = [{**group, "params": [p for p in group["params"] if getattr(p, "expert_parallel", False)]}
               for group in groups]
    if zero_group is None or not any(group["params"] for group in experts):
        return _adamw(groups, config, zero_group)
    dense = [{**group, "params": [p for p in group["params"] if not getattr(p, "expert_parallel", False)]}
             for group in groups]
    return ChainedOptimizer([_adamw([g for g in dense if g["params"]], config, zero_group),
                             _adamw([g for g in experts if g["params"]], config, expert_zero_group)])


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, tp_group=None,
                   dp_shard_group=None, scale: Optional[torch.Tensor] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None, pp_group=None,
                   expert_group=None, expert_shard_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients before clipping; clips to max_norm when max_norm > 0.

    `scale` (a 0-d tensor, e.g. 1 / loss tokens): the gradients are taken as multiplied by it
    first, in the same multiply as the clipping, so the gradients are rewritten once. With
    `optimizer`, that multiply may be left to a fused AdamW's next step (see `scale_gradients`;
    call `forget_gradient_scale` after that step, or if it is skipped).

    Tensor-parallel shards (param.tensor_model_parallel) are summed over tp; replicated
    weights hold the same gradient on every tp rank and count once. Gradients sharded over
    the data-parallel ranks (FSDP2) are summed over `dp_shard_group`, and the stages of a
    pipeline over `pp_group` (the last stage's copy of a tied embedding counts once). Expert
    weights (param.expert_parallel) are split over `expert_group` (the etp x ep ranks) and
    replicated over the expert-data-parallel ones: summed over the former only (and over
    `expert_shard_group` where FSDP2 shards them over their replicas). A
    non-finite norm may leave NaN gradients behind: the caller skips that step and zeroes them.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    device = local_tensor(params[0].grad).device
    squares = _norm_squares(params, device)
    norm = sum_over_layout(squares, tp_group, dp_shard_group, pp_group, expert_group, expert_shard_group).sqrt()
    sharded = [local_tensor(p.grad) for p in params if getattr(p, "tensor_model_parallel", False)]
    replicated = [local_tensor(p.grad) for p in params if not getattr(p, "tensor_model_parallel", False)]
    multiplier = None
    if scale is not None:
        scale = scale.to(device=device, dtype=torch.float32)
        norm, multiplier = norm * scale, scale
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        multiplier = coefficient if multiplier is None else multiplier * coefficient
    if multiplier is not None:
        scale_gradients(sharded + replicated, multiplier, optimizer)
    return norm


def _norm_kind(param: nn.Parameter) -> int:
    """0: split over tp; 1: replicated over tp; 2: an expert weight."""
    if getattr(param, "expert_parallel", False):
        return 2
    return 0 if getattr(param, "tensor_model_parallel", False) else 1


def _norm_squares(params: List[nn.Parameter], device: torch.device) -> torch.Tensor:
    """[sum of squares of the tp-sharded gradients, of the replicated ones, of the experts'] on this rank."""
    return per_kind_sums(params, lambda p: p.grad, _sum_of_squares, device)


def _sum_of_squares(tensors: List[torch.Tensor]) -> torch.Tensor:
    # One multi-tensor kernel per dtype instead of a norm kernel per parameter.
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def per_kind_sums(params: List[nn.Parameter], tensor_of: Callable[[nn.Parameter], torch.Tensor],
                  measure: Callable[[List[torch.Tensor]], torch.Tensor], device: torch.device,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[measure of the tp-sharded tensors, of the replicated ones, of the experts'] on this rank, each
    tensor (`tensor_of(param)`: its gradient, or the weight itself) taken as this rank's local part;
    a tied embedding's second copy and the etp copies of replicated expert biases count nowhere.
    `sum_over_layout` then adds the ranks' parts, counting every element of the model once."""
    counted = [p for p in params if not (getattr(p, "tied_embedding_copy", False)
                                         or getattr(p, "duplicate_in_norm", False))]
    sums = torch.zeros(3, device=device, dtype=dtype)
    for index in range(3):
        tensors = [local_tensor(tensor_of(p)) for p in counted if _norm_kind(p) == index]
        if tensors:
            sums[index] = measure(tensors)
    return sums


def sum_over_layout(sums: torch.Tensor, tp_group=None, dp_shard_group=None, pp_group=None,
                    expert_group=None, expert_shard_group=None) -> torch.Tensor:
    """The whole model's total of `per_kind_sums` (same on every rank): the sharded kinds summed over the
    ranks that split them (see `clip_grad_norm` for which group splits what), then over the stages."""
    for kinds, group in ((slice(0, 2), dp_shard_group), (slice(2, 3), expert_shard_group)):
        if group is not None and dist.get_world_size(group) > 1:
            part = sums[kinds].clone()
            dist.all_reduce(part, group=group)
            sums = torch.cat([sums[:kinds.start], part, sums[kinds.stop:]])
    for index, group in ((0, tp_group), (2, expert_group)):
        if group is not None and dist.get_world_size(group) > 1:
            part = sums[index:index + 1].clone()
            dist.all_reduce(part, group=group)
            sums = torch.cat([sums[:index], part, sums[index + 1:]])
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sums, group=pp_group)
    return sums.sum()


def _folds(optimizer: torch.optim.Optimizer) -> bool:
    if isinstance(optimizer, CompiledAdamW):
        return True
    return (isinstance(optimizer, torch.optim.Adam)
            and all(group.get("fused") for group in optimizer.param_groups))


def folds_gradient_scale(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """True when every local optimizer (the optimizer itself, ZeRO-1's local one, a chain's parts)
    is a torch Adam/AdamW whose every group is fused, or a `CompiledAdamW`: each step divides each
    gradient by its `grad_scale` as it reads it (the hook torch's GradScaler uses)."""
    return optimizer is not None and all(_folds(part) for part in local_optimizers(optimizer))


def scale_gradients(grads: List[torch.Tensor], multiplier: torch.Tensor,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """grads *= multiplier (0-d) before the next step: one multi-tensor multiply, or, for a fused
    AdamW, inside its step, which saves a read and a write of every gradient (about 3 ms a step
    for a 1.7B model on an H200; under ZeRO-1 each rank's step reads only its shard). The
    gradients themselves then stay unscaled."""
    if folds_gradient_scale(optimizer):
        divisor = 1.0 / multiplier.float()
        for part in local_optimizers(optimizer):
            previous = getattr(part, "grad_scale", None)
            part.grad_scale = divisor if previous is None else previous * divisor
        return
    if grads:
        torch._foreach_mul_(grads, multiplier.to(grads[0].dtype))


def forget_gradient_scale(optimizer: torch.optim.Optimizer) -> None:
    """Drop a scale `scale_gradients` left for the step: call after the step, or instead of a skipped one."""
    for part in {id(part): part for part in [optimizer, *local_optimizers(optimizer)]}.values():
        part.__dict__.pop("grad_scale", None)
