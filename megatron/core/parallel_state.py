"""The parallel layout: one ParallelState object holding every process group.

Rank order follows Megatron-LM, read fastest-varying first: tp, cp, dp, pp, i.e.
    rank = tp_rank + cp_rank * TP + dp_rank * TP * CP + pp_rank * TP * CP * DP,
so tensor-parallel peers are adjacent ranks (one NVLink island). Experts use their own grid
over the same ranks, etp-ep-edp-pp (Megatron's "parallel folding": expert tensor parallelism,
expert parallelism, expert data parallelism), sharing the pp dimension:
world = tp*cp*dp*pp = etp*ep*edp*pp.

Modules take the groups they need explicitly (a `ProcessGroups` value). The Megatron-named
functions at the bottom (`initialize_model_parallel`, `get_tensor_model_parallel_rank`,
`get_data_parallel_world_size`, `is_pipeline_last_stage`, ...) are a Megatron-compatibility
shim: they serve code written against Megatron-LM (user model providers, forward steps), read
the state set by `initialize_model_parallel`, the one process-wide object of the package, and
nothing in the package itself calls them (tests/distributed/test_parallel_state_getters.py
checks them on a tp=2 x dp=2 layout). The shim covers the tensor, data, pipeline and context
dimensions a user's script asks about; the expert and embedding groups are only in
`ProcessGroups`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist


def rank_groups(sizes: Dict[str, int], group_dims: Sequence[str]) -> List[List[int]]:
    """All groups over `group_dims` of a grid whose dims are listed fastest-varying first.

    Each group holds the ranks that differ only in `group_dims` (ordered with the first of
    them fastest); one group per combination of the other dims, in rank order.
    """
    names = list(sizes)
    world = int(np.prod([sizes[n] for n in names]))
    # numpy is row-major (last index fastest): reverse so the fastest dim is last.
    grid = np.arange(world).reshape([sizes[n] for n in reversed(names)])
    axes = {name: len(names) - 1 - i for i, name in enumerate(names)}
    other = [axes[n] for n in reversed(names) if n not in group_dims]
    inner = [axes[n] for n in reversed(group_dims)]
    arranged = grid.transpose(other + inner)
    return arranged.reshape(-1, int(np.prod([sizes[n] for n in group_dims]))).tolist()


@dataclass
class ProcessGroups:
    """The groups a model component may need; None means "not parallel" in that dimension."""

    tp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    expert_dp: Optional[dist.ProcessGroup] = None
    embedding: Optional[dist.ProcessGroup] = None
    tp_cp: Optional[dist.ProcessGroup] = None
    """tp x cp: the ranks holding parts of the same sequences (under sequence parallelism)."""
    expert_tp: Optional[dist.ProcessGroup] = None
    """The ranks splitting each expert's inner dim."""
    expert_tp_ep: Optional[dist.ProcessGroup] = None
    """etp x ep: the ranks holding the experts of one layer (the token dispatch group)."""
    intra_dp_cp: Optional[dist.ProcessGroup] = None
    """With --num-distributed-optimizer-instances N > 1: the dp x cp replicas of this rank's
    instance (dp*cp/N consecutive ones), over which the optimizer state (and FSDP2's weights) is
    sharded; None with one instance (the whole replica group then)."""
    inter_dp_cp: Optional[dist.ProcessGroup] = None
    """The replicas at this rank's place in every instance: they hold the same shard (N > 1)."""
    intra_expert_dp: Optional[dist.ProcessGroup] = None
    """The expert-data-parallel ranks of this rank's instance (N > 1)."""
    inter_expert_dp: Optional[dist.ProcessGroup] = None
    """The expert-data-parallel ranks at this rank's place in every instance (N > 1)."""


@dataclass
class ParallelContext(ProcessGroups):
    """The groups plus the two layout facts layers act on when they are built: whether the
    activations between tensor-parallel regions are split over the sequence, and the RNG tracker
    whose tp-rank-specific stream dropout draws from where ranks hold different values. GPTModel
    builds it once (`GPTModel.parallel_context`) and hands it down; a plain ProcessGroups means
    neither (one rank's view: no tracker, no sequence split)."""

    sequence_parallel: bool = False
    rng_tracker: Optional[object] = None
    """A `tensor_parallel.TensorParallelRNGTracker` when tp > 1."""

    @classmethod
    def extend(cls, groups: Optional[ProcessGroups], **facts) -> "ParallelContext":
        groups = groups if groups is not None else ProcessGroups()
        return cls(**{name: getattr(groups, name) for name in ProcessGroups.__dataclass_fields__}, **facts)

    @classmethod
    def build(cls, groups: Optional[ProcessGroups], sequence_parallel: bool) -> "ParallelContext":
        """What a model is built with: the groups, sequence parallelism (on only with tp > 1),
        and, with tp > 1, the tracker whose tp-rank stream drops out what ranks hold differently
        (attention heads; the sequence slices under SP). Everything else draws the default
        stream, identical on every tp rank of a stage. The tracker's seed is the stage's
        (`stage_seed`, as the default stream's is once the model is built: build_trainer). Build it
        once per rank: the model chunks of an interleaved pipeline share it, so their dropout
        streams do not repeat each other."""
        if isinstance(groups, ParallelContext):
            return groups
        from megatron.core.tensor_parallel import group_rank, group_size, model_parallel_rng_tracker, stage_seed

        tp_group = groups.tp if groups is not None else None
        if group_size(tp_group) == 1:
            return cls.extend(groups)
        seed = stage_seed(torch.initial_seed(), group_rank(groups.pp))
        tracker = model_parallel_rng_tracker(seed, group_rank(tp_group))
        return cls.extend(groups, sequence_parallel=sequence_parallel, rng_tracker=tracker)


class ParallelState:
    """Sizes, this rank's coordinates and the process groups of one layout."""

    def __init__(self, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 virtual_pp: Optional[int] = None, etp: int = 1, optimizer_instances: int = 1) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        check_layout(world, tp, pp, cp, ep, etp, optimizer_instances)
        self.optimizer_instances = optimizer_instances
        self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp = world, tp, pp, cp, ep, etp
        self.dp = world // (tp * pp * cp)
        self.expert_dp = world // (etp * ep * pp)
        self.virtual_pp = virtual_pp
        self.grid = {"tp": tp, "cp": cp, "dp": self.dp, "pp": pp}
        self.expert_grid = {"etp": etp, "ep": ep, "edp": self.expert_dp, "pp": pp}
        self.ranks: Dict[str, List[int]] = {}
        grid, experts = self.grid, self.expert_grid
        self.groups = ProcessGroups(
            tp=self._group("tp", grid, ["tp"]), cp=self._group("cp", grid, ["cp"]),
            dp=self._group("dp", grid, ["dp"]), dp_cp=self._group("dp_cp", grid, ["cp", "dp"]),
            pp=self._group("pp", grid, ["pp"]), ep=self._group("ep", experts, ["ep"]),
            expert_dp=self._group("expert_dp", experts, ["edp"]), embedding=self._embedding_group(),
            tp_cp=self._group("tp_cp", grid, ["tp", "cp"]), expert_tp=self._group("expert_tp", experts, ["etp"]),
            expert_tp_ep=self._group("expert_tp_ep", experts, ["etp", "ep"]))
        if optimizer_instances > 1:
            groups = self.groups
            groups.intra_dp_cp, groups.inter_dp_cp = self._instance_groups("dp_cp", grid, ["cp", "dp"])
            groups.intra_expert_dp, groups.inter_expert_dp = self._instance_groups("expert_dp", experts, ["edp"])
        self.pipeline_p2p_groups = self._pipeline_p2p_groups()

    def _instance_groups(self, name: str, grid: Dict[str, int], dims: List[str]):
        """Megatron's partial distributed optimizer: each replica group cut into N instances of
        consecutive ranks (intra), and the ranks at the same place of every instance (inter)."""
        whole = rank_groups(grid, dims)
        size = len(whole[0]) // self.optimizer_instances
        intra = [ranks[start:start + size] for ranks in whole for start in range(0, len(ranks), size)]
        inter = [ranks[place::size] for ranks in whole for place in range(size)]
        return self._new_group(f"intra_{name}", intra), self._new_group(f"inter_{name}", inter)

    def _pipeline_p2p_groups(self) -> Dict[str, Optional[dist.ProcessGroup]]:
        """One group per kind of stage-to-stage traffic (p2p_communication.py says why)."""
        from megatron.core.pipeline_parallel.p2p_communication import LINKS

        if self.pp == 1:
            return {}
        return {link: self._new_group(f"pp_{link}", rank_groups(self.grid, ["pp"])) for link in LINKS}

    def pipeline_links(self, device, variable_shapes: bool = False):
        """This rank's `PipelineLinks` to its neighbouring stages (None without pipelining)."""
        from megatron.core.pipeline_parallel.p2p_communication import PipelineLinks

        if self.pp == 1:
            return None
        return PipelineLinks(self.ranks["pp"], self.rank, self.pipeline_p2p_groups, device, variable_shapes)

    def _new_group(self, name: str, all_groups: List[List[int]]):
        """Every rank creates every group in the same order (required by the backends)."""
        mine = None
        for ranks in all_groups:
            group = dist.new_group(ranks) if dist.is_initialized() else None
            if self.rank in ranks:
                mine, self.ranks[name] = group, ranks
        return mine

    def _group(self, name: str, grid: Dict[str, int], dims: List[str]):
        return self._new_group(name, rank_groups(grid, dims))

    def _embedding_group(self):
        """First and last pipeline stage of each pipeline: they share the tied embedding."""
        stages = rank_groups(self.grid, ["pp"])
        return self._new_group("embedding", [sorted({ranks[0], ranks[-1]}) for ranks in stages])

    def coordinate(self, name: str) -> int:
        return self.ranks[name].index(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    def layout_table(self) -> str:
        """The resolved layout, printed at start-up."""
        rows = [f"  {'world':>6} {'tp':>4} {'cp':>4} {'dp':>4} {'pp':>4} {'ep':>4} {'expert-tp':>10} "
                f"{'expert-dp':>10}",
                f"  {self.world_size:>6} {self.tp:>4} {self.cp:>4} {self.dp:>4} {self.pp:>4} {self.ep:>4} "
                f"{self.etp:>10} {self.expert_dp:>10}",
                "  rank order: tp fastest, then cp, dp, pp (rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP)"]
        return "\n".join(rows)


def check_layout(world: int, tp: int, pp: int, cp: int, ep: int, etp: int = 1, optimizer_instances: int = 1) -> None:
    """One clear message for a layout the world size cannot hold."""
    for name, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                       ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep),
                       ("--expert-tensor-parallel-size", etp)):
        if size < 1:
            raise ValueError(f"{name} {size} must be >= 1")
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size x "
                         f"--pipeline-model-parallel-size x --context-parallel-size = {tp * pp * cp}; "
                         "change the parallel sizes or the number of processes")
    if world % (etp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by --expert-tensor-parallel-size x "
                         f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp * ep * pp}; "
                         "change the expert parallel sizes")
    _check_optimizer_instances(world, tp, pp, cp, ep, etp, optimizer_instances)


def _check_optimizer_instances(world: int, tp: int, pp: int, cp: int, ep: int, etp: int, instances: int) -> None:
    """The replicas (dense and expert) must split into `instances` equal instances (Megatron's rule)."""
    flag = "--num-distributed-optimizer-instances"
    if instances < 1:
        raise ValueError(f"{flag} {instances} must be >= 1")
    for what, replicas in (("data-parallel x context-parallel size", world // (tp * pp)),
                           ("expert-data-parallel size", world // (etp * ep * pp))):
        if replicas % instances:
            raise ValueError(f"{flag} {instances} does not divide the {what} {replicas}; choose a divisor of it")


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              expert_tensor_parallel_size: int = 1,
                              num_distributed_optimizer_instances: int = 1) -> ParallelState:
    global _STATE
    _STATE = ParallelState(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                           expert_model_parallel_size, virtual_pipeline_model_parallel_size,
                           expert_tensor_parallel_size, num_distributed_optimizer_instances)
    return _STATE


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("call megatron.core.parallel_state.initialize_model_parallel(...) first")
    return _STATE


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


# Megatron-named getters (familiar names; the wiring passes ProcessGroups explicitly).
def get_tensor_model_parallel_group():
    return get_parallel_state().groups.tp


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_data_parallel_group(with_context_parallel: bool = False):
    groups = get_parallel_state().groups
    return groups.dp_cp if with_context_parallel else groups.dp


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    state = get_parallel_state()
    return state.dp * (state.cp if with_context_parallel else 1)


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank


def get_pipeline_model_parallel_group():
    return get_parallel_state().groups.pp


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def is_pipeline_first_stage() -> bool:
    return get_parallel_state().pp_rank == 0


def is_pipeline_last_stage() -> bool:
    state = get_parallel_state()
    return state.pp_rank == state.pp - 1


def get_context_parallel_group():
    return get_parallel_state().groups.cp


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp
