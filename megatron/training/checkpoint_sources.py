"""Which checkpoint `--load` takes, and the non-persistent checkpoints (Megatron-LM's meaning).

Non-persistent checkpoints are frequent, cheap saves kept apart from the persistent ones
(`--non-persistent-save-interval`): only the newest is kept, and `--keep-last-checkpoints` never
sees them. Two kinds:
    global  a normal sharded checkpoint (iter_N/ and a tracker) in its own directory,
            `--non-persistent-global-ckpt-dir` (default <save or load>/non_persistent);
    local   every rank writes its own boxes, RNG and metadata into
            `--non-persistent-local-ckpt-dir`/rank_R/iter_N/ (node-local storage). Such a
            checkpoint holds this layout's boxes only, so it loads only under the same layout,
            which the load checks.
Both are written as persistent ones are: into iter_N.tmp/, renamed into place when complete
(a global one's tracker moves after that; a local one's rank directories hold the iterations
that every rank completed, older ones are removed only once all ranks renamed the new one).

`find_checkpoint` chooses: `--ckpt-step N` that iteration wherever it is; otherwise the newer of
the persistent checkpoint (the tracker of --load) and the non-persistent one (the persistent one
on a tie). An incomplete non-persistent save is never chosen: it has no tracker entry (global)
or is not complete on every rank (local). Megatron-LM checkpoints found under --load (legacy
`mp_rank_XX/model_optim_rng.pt`, its own torch_dist, torch_dcp or zarr) are refused with the
conversion to use.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.errors import InputError
from megatron.training.checkpoint_files import (FP8_DIR, STAGING_SUFFIX, TRACKER, barrier, checkpoint_dir,
                                                checkpoint_metadata, global_rank, install_checkpoint, iteration_dir,
                                                latest_iteration, remove_old_checkpoints, save_precision_state)
from megatron.training.configs import CheckpointConfig, RunRecord
from megatron.training.rng_state import capture_rng_state

NON_PERSISTENT_SUBDIR = "non_persistent"
PERSISTENT, NON_PERSISTENT, LOCAL = "persistent", "non-persistent", "local non-persistent"
LOCAL_SHARDS, LOCAL_RNG, LOCAL_FP8 = "shards.pt", "rng.pt", "fp8.pt"
CONVERT = ("convert it to Hugging Face with Megatron-LM's tools (MegaDLMs: tools/weights_conversion/"
           "megatron_to_hf_te.py), then with tools/weights_conversion/hf_to_megatron.py --hf-path HF --save DIR, "
           "and --load DIR --finetune")


@dataclass(frozen=True)
class CheckpointSource:
    path: str
    """The iteration directory (local checkpoints: this rank's)."""
    iteration: int
    kind: str = PERSISTENT

    def rng_path(self, rank: int) -> str:
        return os.path.join(self.path, LOCAL_RNG if self.kind == LOCAL else os.path.join("rng", f"rank_{rank}.pt"))

    def fp8_path(self, rank: int) -> str:
        return os.path.join(self.path, LOCAL_FP8 if self.kind == LOCAL else os.path.join(FP8_DIR, f"rank_{rank}.pt"))


_WARNED = set()


def _warn(message: str) -> None:
    """Once per message: the choice is made before the model is built and again when loading."""
    if global_rank() == 0 and message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def global_root(config: CheckpointConfig, saving: bool) -> str:
    """Megatron's default: the non_persistent folder of --save (saving) or --load (loading)."""
    base = config.save if saving else config.load
    return config.non_persistent_global_ckpt_dir or os.path.join(base, NON_PERSISTENT_SUBDIR)


def local_root(config: CheckpointConfig, rank: int) -> str:
    return os.path.join(config.non_persistent_local_ckpt_dir, f"rank_{rank:05d}")


def complete_iterations(root: str) -> List[int]:
    """Iterations renamed into place under `root` (staged `.tmp` directories are not)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name[5:]) for name in os.listdir(root) if name.startswith("iter_") and name[5:].isdigit()
                  and os.path.exists(os.path.join(root, name, "metadata.json")))


def local_layout(record: RunRecord) -> Dict[str, object]:
    """Everything that decides which boxes a rank holds: a local checkpoint needs all of it equal."""
    config = record.transformer_config
    return {"world_size": record.world_size, "tensor_model_parallel_size": record.tensor_model_parallel_size,
            "pipeline_model_parallel_size": record.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": record.virtual_pipeline_model_parallel_size,
            "data_parallel_size": record.data_parallel_size,
            "context_parallel_size": getattr(config, "context_parallel_size", 1),
            "expert_model_parallel_size": getattr(config, "expert_model_parallel_size", 1),
            "expert_tensor_parallel_size": getattr(config, "expert_tensor_parallel_size", 1),
            "data_parallel_sharding_strategy": record.data_parallel_sharding_strategy,
            "sequence_parallel": record.sequence_parallel}


# ---------------------------------------------------------------------- choosing
def find_checkpoint(config: CheckpointConfig, record: RunRecord) -> Optional[CheckpointSource]:
    """Collective with local non-persistent checkpoints (the ranks agree on one iteration)."""
    refuse_foreign_format(config.load)
    if config.ckpt_step is not None:
        return _named_step(config, record, config.ckpt_step)
    persistent = latest_iteration(config.load)
    chosen = None if persistent is None else CheckpointSource(iteration_dir(config.load, persistent), persistent)
    if config.non_persistent_ckpt_type == "global":
        newer = _global_latest(config)
    elif config.non_persistent_ckpt_type == "local":
        newer = _local_latest(config, record, above=persistent)
    else:
        newer = None
    if newer is not None and (persistent is None or newer.iteration > persistent):
        return newer
    if newer is not None:
        _warn(f"the {newer.kind} checkpoint at iteration {newer.iteration} is not newer than the persistent one "
              f"at iteration {persistent}: loading the persistent one")
    return chosen


def _global_latest(config: CheckpointConfig) -> Optional[CheckpointSource]:
    """The tracker's iteration of the global non-persistent directory, if complete; a broken one
    is skipped with a warning (it never blocks the persistent checkpoint)."""
    root = global_root(config, saving=False)
    if not os.path.isdir(root):
        return None
    try:
        iteration = latest_iteration(root)
    except InputError as error:
        _warn(f"ignoring the non-persistent checkpoints in {root}: {error}")
        return None
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if not os.path.exists(os.path.join(path, "metadata.json")):
        _warn(f"ignoring the non-persistent checkpoint {path}: it has no metadata.json (incomplete)")
        return None
    return CheckpointSource(path, iteration, NON_PERSISTENT)


def _all_gather_ints(values: List[int]) -> List[List[int]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [row.tolist() for row in every]


def _local_latest(config: CheckpointConfig, record: RunRecord, above: Optional[int],
                  wanted: Optional[int] = None) -> Optional[CheckpointSource]:
    """The newest local iteration complete on every rank (or `wanted`, if all have it). Refuses one
    saved under another layout when it would be taken."""
    root = local_root(config, global_rank())
    mine = complete_iterations(root)[-3:]  # a save in flight keeps at most two complete ones
    candidate = wanted if wanted is not None else (mine[-1] if mine else None)
    saved = None
    if candidate in mine and (above is None or candidate > above or wanted is not None):
        with open(os.path.join(checkpoint_dir(root, candidate), "metadata.json")) as handle:
            saved = json.load(handle).get("local_layout")
    mismatch = int(saved is not None and saved != local_layout(record))
    rows = _all_gather_ints([mismatch] + mine + [-1] * (3 - len(mine)))
    if any(row[0] for row in rows):
        detail = (f"iteration {candidate} was saved under {saved}, this run has {local_layout(record)}"
                  if mismatch else "another rank's local checkpoint was saved under another layout")
        raise InputError(f"--non-persistent-local-ckpt-dir {config.non_persistent_local_ckpt_dir}: {detail}; a "
                         "local checkpoint loads only under the layout that wrote it: relaunch with that layout, or "
                         "drop --non-persistent-ckpt-type local to load the persistent checkpoint")
    common = set.intersection(*({v for v in row[1:] if v >= 0} for row in rows))
    if wanted is not None:
        common &= {wanted}
    if not common:
        if any(v >= 0 for row in rows for v in row[1:]) and wanted is None:
            _warn(f"ignoring the local checkpoints in {config.non_persistent_local_ckpt_dir}: no iteration is "
                  "complete on every rank (a node's storage replaced?)")
        return None
    iteration = max(common)
    return CheckpointSource(checkpoint_dir(root, iteration), iteration, LOCAL)


def _named_step(config: CheckpointConfig, record: RunRecord, step: int) -> CheckpointSource:
    """--ckpt-step: the persistent iteration, else the non-persistent one; else one line naming
    the iterations there are."""
    if os.path.isdir(iteration_dir(config.load, step)):
        return CheckpointSource(iteration_dir(config.load, step), step)
    held = {"--load " + config.load: complete_iterations(config.load)}
    if config.non_persistent_ckpt_type == "global":
        root = global_root(config, saving=False)
        if step in complete_iterations(root):
            return CheckpointSource(iteration_dir(root, step), step, NON_PERSISTENT)
        held["non-persistent " + root] = complete_iterations(root)
    elif config.non_persistent_ckpt_type == "local":
        found = _local_latest(config, record, above=None, wanted=step)
        if found is not None:
            return found
        held["local " + config.non_persistent_local_ckpt_dir] = complete_iterations(local_root(config, global_rank()))
    listed = "; ".join(f"{where}: {', '.join(map(str, its)) or 'none'}" for where, its in held.items())
    raise InputError(f"--ckpt-step {step}: no such iteration is saved ({listed}); pass one of those")


# ---------------------------------------------------------------------- formats
def refuse_foreign_format(root: Optional[str]) -> None:
    """A Megatron-LM checkpoint under --load: one line saying how to convert it."""
    tracker = os.path.join(root or "", TRACKER)
    if not root or not os.path.isfile(tracker):
        return
    with open(tracker) as handle:
        text = handle.read().strip()
    source = os.path.join(root, "release") if text == "release" else (
        checkpoint_dir(root, int(text)) if text.isdigit() else None)
    if source is None or not os.path.isdir(source):
        return
    names = set(os.listdir(source))
    kind = None
    if "metadata.json" in names or any(name.startswith("mp_rank_") for name in names):
        return  # ours, or Megatron-LM's torch_dist or legacy torch, which --finetune reads (megatron_lm_checkpoint.py)
    elif ".metadata" in names:
        kind = "Megatron-LM's torch_dcp format"
    if kind is not None:
        raise InputError(f"--load {root}: {source} is a checkpoint in {kind}, which this framework does not read; "
                         + CONVERT)


# ---------------------------------------------------------------------- saving
def finish_global_save(root: str, iteration: int) -> None:
    """Rank 0, after the tracker names `iteration`: only the newest non-persistent checkpoint is
    kept, and staged directories of saves that died are removed."""
    remove_old_checkpoints(root, 1, iteration)
    _remove_dead_stagings(root)


def _remove_dead_stagings(root: str) -> None:
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(STAGING_SUFFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: a box that is part of a larger tensor is copied."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor.detach() if whole and tensor.is_contiguous() else tensor.detach().clone()


def save_local(config: CheckpointConfig, record: RunRecord, trainer, sharded) -> str:
    """Collective. This rank's boxes (`sharded`), RNG and metadata into its own directory."""
    rank, iteration = global_rank(), trainer.state.iteration
    root = local_root(config, rank)
    os.makedirs(root, exist_ok=True)
    staged = checkpoint_dir(root, iteration) + STAGING_SUFFIX
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    torch.save({name: _own_storage(piece.data) for name, piece in sharded.items()},
               os.path.join(staged, LOCAL_SHARDS))
    if not config.no_save_rng:
        torch.save(capture_rng_state(trainer.model), os.path.join(staged, LOCAL_RNG))
    save_precision_state(trainer, os.path.join(staged, LOCAL_FP8))
    metadata = {**checkpoint_metadata(record, trainer, iteration), "local_layout": local_layout(record), "rank": rank}
    with open(os.path.join(staged, "metadata.json"), "w") as handle:
        json.dump(metadata, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    final = install_checkpoint(root, iteration, staged)
    barrier()  # every rank holds iteration N now: the older ones can go
    remove_old_checkpoints(root, 1, iteration)
    _remove_dead_stagings(root)
    return final


def load_local(sharded, source: CheckpointSource) -> None:
    """Fill this rank's boxes, in place, from its own file (same layout: the same boxes)."""
    saved = torch.load(os.path.join(source.path, LOCAL_SHARDS), map_location="cpu", weights_only=True)
    for name, piece in sharded.items():
        stored = saved.get(name)
        if stored is None or tuple(stored.shape) != tuple(piece.data.shape):
            found = "missing" if stored is None else f"of shape {tuple(stored.shape)}"
            raise InputError(f"{source.path}: box {name} is {found}, this run's is {tuple(piece.data.shape)}; the "
                             "local checkpoint does not fit this model: drop --non-persistent-ckpt-type local")
        piece.data.copy_(stored)


def describe(source: CheckpointSource, config: CheckpointConfig) -> str:
    """The loaded line's tail: which checkpoint was taken and why."""
    if source.kind == PERSISTENT:
        return "" if config.non_persistent_ckpt_type is None else " (the persistent checkpoint)"
    why = "--ckpt-step" if config.ckpt_step is not None else "newer than the persistent one"
    return f" (the {source.kind} checkpoint {source.path}: {why})"

