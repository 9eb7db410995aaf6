"""Data parallelism: torch DDP and FSDP2, with Megatron's per-token loss normalisation.

`--data-parallel-sharding-strategy` (`--use-distributed-optimizer` = optim):
- no_shard: DDP; bucketed all-reduce overlapped with backward.
- optim: DDP + ZeroRedundancyOptimizer, the optimizer state split over the replicas (ZeRO-1).
- optim_grads: FSDP2 per layer, gradients reduce-scattered, weights kept gathered between
  forward and backward (ZeRO-2 traffic, no re-gather in backward).
- optim_grads_params: FSDP2 per layer with weights re-sharded after forward (ZeRO-3).
Every strategy skips gradient synchronisation on non-final micro-batches. Tensor-parallel
layers are plain local tensors, so FSDP2 shards each tp rank's slice over the dp group.

Under pipeline parallelism a stage's last backward comes after forwards of later
micro-batches, which DDP's per-forward bookkeeping cannot follow: there, no_shard and optim
keep the bare model and `finalize_gradients` sums the gradients over the replicas in
flattened buckets after the schedule; FSDP2 wraps each model chunk and reduce-scatters on
its last micro-batch (schedules.py). `optim_grads_params` keeps its meaning under PP: the
weights are re-gathered for every micro-batch's forward and backward (ZeRO-3 memory, more
all-gathers); `optim_grads` keeps them gathered between them, the cheaper choice when the
gathered weights of a stage fit.

Expert weights (tagged `expert_parallel`, moe/experts.py) are replicated over the expert-data-
parallel ranks instead: DDP leaves them alone, and `finalize_gradients` sums them over
`expert_dp` and divides by the dense replicas' count, so that the one scale applied to every
gradient (below) turns both kinds into gradients of the same loss.

Micro-batches backpropagate the *sum* of their weighted token losses; after the last one the
gradients are taken as divided by the normalizer of the whole global batch (all micro-batches,
all data-parallel ranks: loss_normalization.py). Gradient accumulation and data parallelism
then equal one big batch exactly, whatever the split.

`DataParallelConfig` carries Megatron's DDP settings that apply here: distributed-optimizer
instances (HSDP under FSDP2: a 2-D mesh, replicated over the instances, sharded within one),
bf16 gradient reduction, the bf16 weights FSDP2 gathers under --bf16, DDP's bucket size and
FSDP2's explicit forward prefetch.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from megatron.core.pipeline_parallel.chunks import ModelChunks, model_chunks
from megatron.core.tensor_parallel.fp32_weight_grad import accumulating_into_grad
from megatron.core.tensor_parallel.utils import group_size, local_tensor

if TYPE_CHECKING:
    from megatron.core.distributed.loss_normalization import GlobalBatchLoss

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Attributes the tensor-parallel code reads from parameters; FSDP2 replaces the Parameter
# objects, so they are carried over by name.
_PARAM_TAGS = ("tensor_model_parallel", "partition_dim", "allreduce_over_tp", "tied_across_stages",
               "tied_embedding_copy", "expert_parallel", "allreduce_over_expert_tp", "duplicate_in_norm")
_BUCKET_ELEMENTS = 1 << 25  # gradients summed per all-reduce under pipeline parallelism (default)
InstanceGroups = Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]]
"""(intra, inter): the replicas of this rank's distributed-optimizer instance, and this rank's
peers in the other instances; None with one instance."""


@dataclass
class DataParallelConfig:
    """Megatron's DistributedDataParallelConfig, the part that applies to torch DDP and FSDP2."""

    strategy: str = "no_shard"
    """--data-parallel-sharding-strategy."""
    grad_reduce_dtype: Optional[torch.dtype] = None
    """bf16 with --grad-reduce-in-bf16: gradients cross the wire (and FSDP2 sums them) in bf16;
    None: in the gradients' own dtype (fp32)."""
    param_dtype: Optional[torch.dtype] = None
    """FSDP2: the dtype the transformer layers' weights are all-gathered and computed in (bf16
    under --bf16); None: the fp32 weights themselves."""
    bucket_size: Optional[int] = None
    """--ddp-bucket-size: gradient elements per DDP all-reduce bucket (and per flat all-reduce under
    pipeline parallelism); None: torch DDP's default (25 MiB)."""
    num_buckets: Optional[int] = None
    """--ddp-num-buckets: instead of `bucket_size`, the model's (chunk's) replicated trainable
    elements divided into this many buckets (Megatron's rule)."""
    forward_prefetch: bool = False
    """--overlap-param-gather under FSDP2: each layer's forward issues the next layer's all-gather
    before computing, instead of when the next layer starts."""


def wrap_data_parallel(model: nn.Module, device: torch.device, group=None, strategy: str = "no_shard",
                       pipeline: bool = False, expert_group=None, config: Optional[DataParallelConfig] = None,
                       instances: InstanceGroups = None, expert_instances: InstanceGroups = None) -> nn.Module:
    """The model wrapped for `strategy` over `group`; the bare model with one replica. With
    `pipeline` (a stage of a pipeline), every chunk of a ModelChunks is wrapped by itself. FSDP2
    shards MoE experts over `expert_group` (their expert-data-parallel replicas); with
    `instances` (and `expert_instances`) it shards within an instance and replicates across them."""
    config = config if config is not None else DataParallelConfig(strategy=strategy)
    if config.num_buckets is not None:  # Megatron's rule: the rank's replicated elements / buckets
        config = replace(config, num_buckets=None, bucket_size=_bucket_elements(model, config))
    strategy = config.strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"--data-parallel-sharding-strategy {strategy!r} is not one of {list(STRATEGIES)}")
    if group_size(group) == 1:
        return model
    if isinstance(model, ModelChunks):
        model.chunks = nn.ModuleList([wrap_data_parallel(chunk, device, group, strategy, pipeline, expert_group,
                                                         config, instances, expert_instances)
                                      for chunk in model.chunks])
        model.data_parallel_group, model.sums_gradients = group, pipeline and strategy in ("no_shard", "optim")
    elif pipeline and strategy in ("no_shard", "optim"):
        model.data_parallel_group, model.sums_gradients = group, True
    elif strategy in ("no_shard", "optim"):
        model = _ddp(model, device, group, config)
    else:
        meshes = (_mesh(device, group, instances), _mesh(device, expert_group, expert_instances))
        model = _fully_shard(model, meshes, group, strategy == "optim_grads_params", config)
    # Read by the flat all-reduces of finalize_gradients (pipeline stages, experts).
    model.grad_reduce_dtype, model.bucket_size = config.grad_reduce_dtype, config.bucket_size
    return model


def _bucket_elements(model: nn.Module, config: DataParallelConfig) -> int:
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad and not is_expert(p))
    return max(1, numel // config.num_buckets)


def _ddp(model: nn.Module, device: torch.device, group, config: DataParallelConfig) -> nn.Module:
    device_ids = [device] if device.type == "cuda" else None
    experts = [name for name, param in model.named_parameters() if is_expert(param)]
    if experts:  # summed over expert-dp in finalize_gradients
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    kwargs = {}
    if config.bucket_size is not None:  # Megatron counts elements, DDP MiB of gradients (fp32 here)
        grad_bytes = next(p for p in model.parameters() if p.requires_grad).element_size()
        kwargs["bucket_cap_mb"] = config.bucket_size * grad_bytes / 2 ** 20
    # Buffers are derived tables (RoPE), identical everywhere: no broadcast per step. torch 2.13 renamed
    # the switch (the old name warns there); 2.11 and 2.12 know only the old one.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                      gradient_as_bucket_view=True, **kwargs)
    if config.grad_reduce_dtype is not None:
        wrapped.register_comm_hook((group, config.grad_reduce_dtype), _compressed_allreduce_hook)
    return wrapped


def _compressed_allreduce_hook(state, bucket):
    """DDP's bucket all-reduce in a lower dtype (torch's bf16_compress_hook needs NCCL): the
    bucket divided by the replicas in its own dtype, cast, summed in that dtype, written back.
    `state` is (group, dtype); no annotations, since DDP checks them as objects and this module
    postpones their evaluation."""
    group, dtype = state
    buffer = bucket.buffer()
    compressed = buffer.div(group_size(group)).to(dtype)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


def _mesh(device: torch.device, group, instances: InstanceGroups):
    """FSDP2's mesh: 1-D over `group`; with distributed-optimizer instances 2-D (HSDP),
    [instance, place in the instance], replicated over dim 0 and sharded over dim 1."""
    from torch.distributed.device_mesh import DeviceMesh

    if group_size(group) == 1:
        return None
    if instances is None:
        return DeviceMesh.from_group(group, device.type)
    intra, inter = instances
    ranks = torch.tensor(sorted(dist.get_process_group_ranks(group)), dtype=torch.int)
    return DeviceMesh.from_group([inter, intra], device.type, mesh=ranks.view(group_size(inter), -1),
                                 mesh_dim_names=("replicate", "shard"))


def _precision(config: DataParallelConfig, layer: bool):
    """FSDP2's MixedPrecisionPolicy. Under --bf16 the layers gather bf16 weights (their inputs
    are not cast: the residual stream stays fp32, as autocast keeps it) and reduce in fp32; the
    root (embedding, final norm, output layer) keeps fp32 weights, so the embedding still feeds
    the fp32 residual stream."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = config.param_dtype if layer else None
    reduce_dtype = config.grad_reduce_dtype or (torch.float32 if param_dtype is not None else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def _shard_experts(layer: nn.Module, mesh, reshard_after_forward: bool, config: DataParallelConfig) -> set:
    """MoE experts sharded over their own replicas (`mesh`: the expert-dp group), before the
    layer's dense weights are sharded over the dense ones; returns the expert weights the layer's
    FSDP2 must leave alone (all of them when there is one expert-dp replica: nothing to shard)."""
    from torch.distributed.fsdp import fully_shard

    experts = [module for module in layer.modules()
               if any(is_expert(p) for p in module.parameters(recurse=False))]
    owners = {module for module in layer.modules() for child in module.children() if child in experts}
    if mesh is None:
        return {p for module in experts for p in module.parameters(recurse=False)}
    for module in owners:  # the GroupedExperts holding linear_fc1 / linear_fc2
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=_precision(config, layer=True))
    return set()


def _fully_shard(model: nn.Module, meshes: tuple, group, reshard_after_forward: bool,
                 config: DataParallelConfig) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    tags = {name: {tag: getattr(p, tag) for tag in _PARAM_TAGS if hasattr(p, tag)}
            for name, p in model.named_parameters()}
    mesh, expert_mesh = meshes
    layers = list(getattr(getattr(model, "decoder", None), "layers", {}).values())
    ignored = set()
    for layer in layers:  # one all-gather / reduce-scatter per layer, overlapped with compute
        kept = _shard_experts(layer, expert_mesh, reshard_after_forward, config)
        ignored |= kept
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept or None,
                    mp_policy=_precision(config, layer=True))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                mp_policy=_precision(config, layer=False))
    if config.forward_prefetch:
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
    for name, param in model.named_parameters():
        for tag, value in tags[name].items():
            setattr(param, tag, value)
    model.data_parallel_group, model.reshard_after_forward = group, reshard_after_forward
    return model


@contextmanager
def whole_weights(model: nn.Module):
    """FSDP2 (no-op otherwise): every sharded module's weights gathered once up front and kept gathered through
    the forwards inside, then sharded again. A forward then needs no all-gather, so ranks may run different
    numbers of forwards (RL replicas sampling to different lengths), and forwards that bypass a module's hooks
    (inference_forward: the root's embedding, final norm and output layer) see whole weights. Each rank holds
    the whole model meanwhile."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if sharded:
        # FSDP2 makes the first module to run forward its root: before any training forward (RL's first
        # rollouts) that would be a layer; initialize from the model's root as its forward does (idempotent).
        model._get_fsdp_state()._lazy_init()
    for module in sharded:
        module.unshard()
    if sharded:
        model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        if sharded:
            model.set_reshard_after_forward(model.reshard_after_forward)
            for module in sharded:
                module.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_fully_sharded(model: nn.Module) -> bool:
    return all(hasattr(chunk, "set_requires_gradient_sync") for chunk in model_chunks(model))


def no_sync(model: nn.Module, last_microbatch: bool) -> ContextManager:
    """Skip the gradient reduction on every micro-batch but the last. Also lets the linear layers add
    their weight gradients into `.grad` in place (`fp32_weight_grad.accumulating_into_grad`) wherever
    no wrapper's autograd hook needs to see them: in one process or under the schedules' own
    reductions on every micro-batch, under DDP on its no-sync ones, under FSDP2 never."""
    ddp, fsdp = isinstance(model, DistributedDataParallel), is_fully_sharded(model)
    stack = ExitStack()
    stack.enter_context(accumulating_into_grad(model, not fsdp and not (ddp and last_microbatch)))
    if not last_microbatch and ddp:
        stack.enter_context(model.no_sync())
    elif not last_microbatch and fsdp:
        stack.enter_context(_fsdp_no_sync(model))
    return stack


@contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def data_parallel_group(model: nn.Module):
    if isinstance(model, DistributedDataParallel):
        return model.process_group
    return getattr(model, "data_parallel_group", None)


def data_parallel_size(model: nn.Module) -> int:
    return group_size(data_parallel_group(model))


def averaging_replicas(model: nn.Module) -> int:
    """How many replicas' gradients the synchronisation averaged (DDP, FSDP2); 1 where it summed them."""
    return 1 if getattr(model, "sums_gradients", False) else data_parallel_size(model)


def _allreduce_flat(grads: List[torch.Tensor], group, dtype: Optional[torch.dtype] = None,
                    bucket_elements: Optional[int] = None) -> None:
    """Sum `grads` over `group` in place, in flattened buckets of one dtype (summed in `dtype`
    when given: --grad-reduce-in-bf16)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        bucket, size = [], 0
        for grad in same + [None]:
            if grad is not None:
                bucket.append(grad)
                size += grad.numel()
            if bucket and (grad is None or size >= (bucket_elements or _BUCKET_ELEMENTS)):
                flat = torch.cat([g.reshape(-1) for g in bucket]).to(dtype or bucket[0].dtype)
                dist.all_reduce(flat, group=group)
                for target, chunk in zip(bucket, flat.split([g.numel() for g in bucket])):
                    target.copy_(chunk.view_as(target))
                bucket, size = [], 0


def is_expert(param: nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)


def allreduce_pipeline_stage_grads(model: nn.Module, embedding_group=None) -> None:
    """After a pipeline schedule: the replicas' gradients summed (where no wrapper synchronised
    them), and the tied word-embedding copies of the first and last stage summed over
    `embedding_group`, so both copies take the same step."""
    if getattr(model, "sums_gradients", False):
        _allreduce_flat([local_tensor(p.grad) for p in model.parameters() if p.grad is not None and not is_expert(p)],
                        model.data_parallel_group, getattr(model, "grad_reduce_dtype", None),
                        getattr(model, "bucket_size", None))
    tied = [p for p in model.parameters() if getattr(p, "tied_across_stages", False)]
    if tied and group_size(embedding_group) > 1:
        for param in tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        _allreduce_flat([local_tensor(p.grad) for p in tied], embedding_group)


def allreduce_tensor_parallel_partial_grads(model: nn.Module, tp_group) -> None:
    """Sum over tp the gradients of replicated weights that each rank saw only part of (tagged
    `allreduce_over_tp`): under sequence parallelism every weight applied to the sequence-split
    activations (norm weights and biases, row-parallel biases); QK-norms, shared by heads split
    over ranks, always."""
    if group_size(tp_group) == 1:
        return
    grads = []
    for param in model.parameters():
        if param.grad is not None and getattr(param, "allreduce_over_tp", False):
            grads.append(local_tensor(param.grad))
    if grads:
        _allreduce_flat(grads, tp_group)


def allreduce_expert_grads(model: nn.Module, expert_dp_group=None, expert_tp_group=None) -> None:
    """Expert gradients summed over the expert-data-parallel replicas (and the etp-replicated
    biases over etp), then divided by the number of dense replicas the wrapper averaged over:
    afterwards they are on the footing of the dense gradients. A rank whose experts got no token
    still joins the sums (with zeros)."""
    params = [p for p in model.parameters() if is_expert(p) and p.requires_grad]
    if not params:
        return
    # FSDP2 reduce-scattered its experts' gradients over expert-dp already, as a mean.
    sharded = [p for p in params if hasattr(p.grad, "to_local")]
    if sharded:
        torch._foreach_mul_([local_tensor(p.grad) for p in sharded], float(group_size(expert_dp_group)))
    experts = [p for p in params if not hasattr(p.grad, "to_local")]
    for param in experts:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if group_size(expert_dp_group) > 1:
        _allreduce_flat([local_tensor(p.grad) for p in experts], expert_dp_group,
                        getattr(model, "grad_reduce_dtype", None), getattr(model, "bucket_size", None))
    experts = experts + sharded
    biases = [local_tensor(p.grad) for p in experts if getattr(p, "allreduce_over_expert_tp", False)]
    if biases and group_size(expert_tp_group) > 1:
        _allreduce_flat(biases, expert_tp_group)
    replicas = averaging_replicas(model)
    if replicas > 1:
        torch._foreach_mul_([local_tensor(p.grad) for p in experts], 1.0 / replicas)


def finalize_gradients(model: nn.Module, loss: "GlobalBatchLoss", tp_group=None,
                       embedding_group=None, expert_dp_group=None, expert_tp_group=None) -> torch.Tensor:
    """Complete the gradients (pipeline stages' replica sums and tied embeddings, the experts'
    over their replicas, then the tensor-parallel partial ones); returns the factor that turns
    the summed gradients into gradients of the reduced batch `loss`, for
    `clip_grad_norm(scale=...)` to apply together with the clipping."""
    allreduce_pipeline_stage_grads(model, embedding_group)
    allreduce_expert_grads(model, expert_dp_group, expert_tp_group)
    allreduce_tensor_parallel_partial_grads(model, tp_group)
    return loss.gradient_scale(averaging_replicas(model))


def optimizer_sharding_group(strategy: str, group) -> Optional[dist.ProcessGroup]:
    """The group a ZeRO-1 optimizer splits its state over (None when it keeps it whole): the
    replicas, or with distributed-optimizer instances those of this rank's instance."""
    return group if strategy == "optim" and group_size(group) > 1 else None
