"""--save / --load: sharded checkpoints on torch.distributed.checkpoint, exact resume.

Layout of `--save DIR`:
    DIR/iter_0000100/            DCP shards of the model and the optimizer state (`model.*`,
                                 `optimizer.exp_avg.*`, ...), in layout-independent global shapes
    DIR/iter_0000100/metadata.json   format version, model/DLM config, layout, tokenizer, TrainState
    DIR/iter_0000100/rng/rank_N.pt   every RNG of rank N (tensors only, loaded with weights_only)
    DIR/iter_0000100/fp8/rank_N.pt   --fp8-recipe delayed: rank N's amax histories and scales (likewise)
    DIR/latest_checkpointed_iteration.txt   written last, atomically, once every rank finished
Nothing in a checkpoint is unpickled as arbitrary objects (DCP's `.metadata` index goes through
an allow-list unpickler, RNG states through `weights_only`). The diffusion corruption needs no
state: it is keyed by (seed, sample index), so a resumed run draws the same masks.

Nothing is written in place: every rank writes into `iter_N.tmp/`; once all are done, rank 0
renames it to `iter_N/` (an existing `iter_N/` is first renamed aside to `iter_N.replaced/` and
deleted after), then moves the tracker. A crash at any moment leaves the tracker naming a
complete directory: `iter_N/`, or between the two renames `iter_N.replaced/`, which readers
fall back to (`iteration_dir`). Those names and files are checkpoint_files.py's; which checkpoint
`--load` takes and the non-persistent ones are checkpoint_sources.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import Future
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.errors import InputError
from megatron.training.checkpoint_args import check_compatible
from megatron.training.checkpoint_files import (FORMAT_VERSION, FP8_DIR, STAGING_SUFFIX, TRACKER, barrier,
                                                checkpoint_dir, checkpoint_metadata, configs_from_metadata, global_rank,
                                                iteration_dir,
                                                install_checkpoint, latest_iteration, load_precision_state,
                                                read_checkpoint_metadata, remove_old_checkpoints,
                                                save_precision_state, write_tracker)
from megatron.training.checkpoint_sources import (LOCAL, describe, find_checkpoint, finish_global_save, global_root,
                                                  load_local, save_local)
from megatron.training.configs import CheckpointConfig, RunRecord
from megatron.training.megatron_lm_checkpoint import (is_megatron_lm_checkpoint, load_megatron_lm_model,
                                                      megatron_lm_iteration_dir, read_megatron_lm_args)
from megatron.training.rng_state import capture_rng_state, restore_rng_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict, optimizer_sharded_state_dict
from megatron.core.optimizer.optimizer import local_optimizers
from megatron.core.distributed.data_parallel import unwrap


def _serialization():
    """The DCP reader/writer, imported when a checkpoint is first written or read: importing
    torch.distributed.checkpoint costs about 1.3 s of every process's start-up otherwise."""
    from megatron.core.dist_checkpointing import serialization

    return serialization


def _optimizer_sharded_state(model, optimizer) -> Dict[str, ShardedTensor]:
    """AdamW's per-parameter state described with the parameter's own boxes. Under ZeRO-1 a
    rank holds (and so writes and reads) the state of the weights it owns only (with MoE, of the
    dense weights and of the experts, each optimizer sharded over its own replicas)."""
    sharded = {}
    for part in local_optimizers(optimizer):
        if not isinstance(part, torch.optim.AdamW):
            raise ValueError(f"checkpointing the optimizer state supports AdamW, not {type(part).__name__}; "
                             "pass --no-save-optim to save the weights only")
        sharded.update(optimizer_sharded_state_dict(unwrap(model), part))
    return sharded


def _sharded_state(config: CheckpointConfig, trainer) -> Dict[str, ShardedTensor]:
    sharded = model_sharded_state_dict(unwrap(trainer.model))
    if not config.no_save_optim:
        sharded.update(_optimizer_sharded_state(trainer.model, trainer.optimizer))
    return sharded


def save_checkpoint(config: CheckpointConfig, record: RunRecord, trainer,
                    process_group=None, root: Optional[str] = None) -> Tuple[str, Optional[Future]]:
    """Collective. Writes the shards (in the background with `--async-save`: the returned future
    completes when this rank's files are written), RNG states (unless --no-save-rng) and
    metadata into `root` (default --save). The tracker is moved by `finalize_save` once every
    rank finished, never here."""
    iteration = trainer.state.iteration
    target = checkpoint_dir(root or config.save, iteration) + STAGING_SUFFIX
    rank = global_rank()
    if rank == 0 and os.path.isdir(target):  # a save of N that died earlier: never part of a checkpoint
        shutil.rmtree(target)
    barrier()
    sharded = _sharded_state(config, trainer)
    planning = dict(fully_parallel=config.ckpt_fully_parallel_save, cache_plan=config.ckpt_assume_constant_structure)
    with reporting_failed_writes(root or config.save, iteration):
        if config.async_save:
            future = _serialization().save_async(sharded, target, process_group, **planning)
        else:
            _serialization().save(sharded, target, **planning)
            future = None
        if not config.no_save_rng:
            os.makedirs(os.path.join(target, "rng"), exist_ok=True)
            torch.save(capture_rng_state(trainer.model), os.path.join(target, "rng", f"rank_{rank}.pt"))
        save_precision_state(trainer, os.path.join(target, FP8_DIR, f"rank_{rank}.pt"))
        if rank == 0:
            with open(os.path.join(target, "metadata.json"), "w") as handle:
                json.dump(checkpoint_metadata(record, trainer, iteration), handle, indent=1)
    return target, future


@contextlib.contextmanager
def reporting_failed_writes(root: str, iteration: int):
    """A save of `iteration` into `root` that the file system refuses (a full disk, a quota, a
    read-only mount: an OSError on this rank, or on any rank DCP gathered its failures from)
    becomes one InputError saying what still loads. Nothing is lost: the files were staged in
    `iter_N.tmp/`, which is never loaded and is deleted here, and the tracker was not moved."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP is imported by the save itself

    try:
        yield
    except (OSError, CheckpointException) as error:
        failures = error.failures.values() if isinstance(error, CheckpointException) else [(error, None)]
        cause = next((failure for failure, _ in failures if isinstance(failure, OSError)), None)
        if cause is None:
            raise
        staged = checkpoint_dir(root, iteration) + STAGING_SUFFIX
        if global_rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)
        try:
            previous = latest_iteration(root, missing_ok=True)
        except (InputError, OSError):
            previous = None
        kept = (f"{TRACKER} still names iteration {previous}, which --load {root} resumes from"
                if previous is not None else f"{root} holds no earlier checkpoint")
        raise InputError(f"--save {root}: saving iteration {iteration} failed ({cause.strerror or cause}"
                         f"{': ' + str(cause.filename) if cause.filename else ''}); {kept}; the partial "
                         f"{os.path.basename(staged)} is never loaded and was deleted: free space (or give "
                         "--save another disk) and run again") from None


def finalize_save(config: CheckpointConfig, iteration: int, root: Optional[str] = None,
                  non_persistent: bool = False) -> str:
    """Collective, once every rank's files are written: rename the staged directory into place,
    move the tracker (never backwards), drop this run's older checkpoints (of a non-persistent
    `root`: all but this one). Returns the path."""
    barrier()
    root = root or config.save
    final = checkpoint_dir(root, iteration)
    if global_rank() == 0:
        install_checkpoint(root, iteration, final + STAGING_SUFFIX)
        newest = latest_iteration(root, missing_ok=True)
        if newest is None or newest <= iteration:
            write_tracker(root, iteration)
        else:
            print(f"warning: {root} already holds iteration {newest}, newer than this save ({iteration}); "
                  f"{TRACKER} keeps naming {newest}", file=sys.stderr, flush=True)
        if non_persistent:
            finish_global_save(root, iteration)
        else:
            remove_old_checkpoints(root, config.keep_last_checkpoints, iteration)
    barrier()
    return final


class Checkpointer:
    """`--save` for the training loop: synchronous saves, or with `--async-save` one save in
    flight while training goes on. Shards are staged to host memory before the loop
    continues; the tracker moves only after all ranks report their writes done (polled once
    a step, a one-element all-reduce, while a save is pending). Non-persistent saves
    (checkpoint_sources.py) go to their own directory; local ones are written synchronously."""

    def __init__(self, config: CheckpointConfig, record: RunRecord, log: Callable[[str], None] = print) -> None:
        self.config, self.record, self.log = config, record, log
        self.pending: Optional[Tuple[int, str, Future, bool]] = None
        # DCP's collectives run in the writer thread: they get their own group, so they never
        # interleave with the training loop's collectives on the default one.
        self.group = dist.new_group(backend="gloo") if config.async_save and dist.is_initialized() else None

    def due(self, iteration: int) -> bool:
        """Whether --save-interval or --checkpoint-steps asks for a (persistent) save after `iteration`."""
        interval = self.config.save_interval
        return bool(interval) and iteration % interval == 0 or iteration in self.config.checkpoint_steps

    def non_persistent_due(self, iteration: int) -> bool:
        """Whether --non-persistent-save-interval asks for one (checked only where `due` is not)."""
        interval = self.config.non_persistent_save_interval
        return bool(interval) and self.config.non_persistent_ckpt_type is not None and iteration % interval == 0

    def save(self, trainer, non_persistent: bool = False) -> None:
        self.finalize(blocking=True)  # one save in flight at a time
        started = time.perf_counter()
        if non_persistent and self.config.non_persistent_ckpt_type == "local":
            target = save_local(self.config, self.record, trainer, _sharded_state(self.config, trainer))
            self.log(f"> saved {target} (local non-persistent, {time.perf_counter() - started:.2f} s)")
            return
        root = None
        if non_persistent:
            root = global_root(self.config, saving=True)
        target, future = save_checkpoint(self.config, self.record, trainer, self.group, root)
        blocked = time.perf_counter() - started
        if future is None:
            target = finalize_save(self.config, trainer.state.iteration, root, non_persistent)
            self.log(f"> saved {target} ({blocked:.2f} s)")
            return
        self.pending = (trainer.state.iteration, root, future, non_persistent)
        self.log(f"> async save of {target} started; training blocked {blocked:.2f} s")

    def finalize(self, blocking: bool, iteration: Optional[int] = None) -> None:
        """Complete a pending async save if every rank is done (or wait for it, when blocking)."""
        if self.pending is None:
            return
        saved_iteration, root, future, non_persistent = self.pending
        if blocking:
            with reporting_failed_writes(root or self.config.save, saved_iteration):
                future.result()  # re-raises a failed write
        done = torch.tensor([1.0 if future.done() else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                done = done.cuda()
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() < 1.0:
            return
        self.pending = None
        with reporting_failed_writes(root or self.config.save, saved_iteration):
            future.result()
        target = finalize_save(self.config, saved_iteration, root, non_persistent)
        after = "" if iteration is None else f" (completed during iteration {iteration})"
        self.log(f"> saved {target}{after}")


def load_inference_model(root: str, device: torch.device, attention_backend: Optional[str] = None):
    """(GPTModel in eval mode, metadata) of the latest checkpoint under `root`, in this one
    process whatever layout it was saved with: bf16 weights on CUDA, fp32 on CPU. What
    generation, evaluation and their benchmarks load."""
    from megatron.core.models.difflm.gpt_model import GPTModel

    iteration = latest_iteration(root)
    if iteration is None:
        raise InputError(f"--load {root}: no {TRACKER}; point it at a --save directory")
    source = iteration_dir(root, iteration)
    metadata = read_checkpoint_metadata(source)
    config, dlm = configs_from_metadata(metadata)
    config = config.replace(bf16=device.type == "cuda", attention_backend=attention_backend or config.attention_backend)
    with torch.device(device):  # no host-side init of billions of weights
        model = GPTModel(config, dlm)
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: intended
        warnings.simplefilter("ignore")
        _serialization().load(model.sharded_state_dict(prefix="model."), source)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    metadata["source"] = source
    return model.eval(), metadata


def load_model_weights(root: str, model: torch.nn.Module, flag: str = "--load") -> int:
    """Collective. The weights of the latest checkpoint under `root` into `model` (this rank's part of it,
    whatever layout saved them), nothing else; returns its iteration. A second model of the run (RL's
    frozen reference policy) loads this way."""
    iteration = latest_iteration(root) if os.path.isdir(root) else None
    if iteration is None:
        raise InputError(f"{flag} {root}: no {TRACKER}; point it at a --save directory")
    _serialization().load(model_sharded_state_dict(model), iteration_dir(root, iteration))
    return iteration


def check_loadable(config: CheckpointConfig, record: RunRecord) -> None:
    """The checks of `load_checkpoint` that need no model: run before building one (collective
    with local non-persistent checkpoints)."""
    if config.load and is_megatron_lm_checkpoint(config.load):
        if not config.finetune:
            raise InputError(f"--load {config.load} is a Megatron-LM checkpoint: add --finetune (its weights are "
                             "read; its optimizer state, progress and RNG are Megatron-LM's and are not)")
        read_megatron_lm_args(megatron_lm_iteration_dir(config.load))  # a common.pt that cannot be read: now
        return
    source = find_checkpoint(config, record)
    if source is None and config.exit_on_missing_checkpoint:
        raise InputError(f"--load {config.load}: no checkpoint there (no {TRACKER}) and --exit-on-missing-checkpoint "
                         "is set; check the path, or drop the flag to start from scratch")
    if source is not None:
        _check_compatible(record, config.finetune, read_checkpoint_metadata(source.path), source.path)
        if source.kind != LOCAL:  # the files' sizes against the index: before the model is built
            with _naming_earlier_iterations(source):
                _serialization().check_shard_files(source.path)


@contextlib.contextmanager
def _naming_earlier_iterations(source):
    """A damaged shard of the iteration `source` holds is reported with the iterations beside it that
    could be loaded instead."""
    from megatron.core.dist_checkpointing.safe_reader import DamagedCheckpointError  # imports DCP

    try:
        yield
    except DamagedCheckpointError as error:
        root, iteration = os.path.dirname(source.path), source.iteration
        saved = sorted(int(name[5:]) for name in os.listdir(root)
                       if name.startswith("iter_") and name[5:].isdigit() and int(name[5:]) < iteration)
        if not saved:
            raise error.with_fix(f"{root} holds no earlier iteration: copy iteration {iteration} again, or start "
                                 "from scratch without --load") from None
        raise error.with_fix(f"load an earlier iteration with --ckpt-step {saved[-1]} (saved: "
                             f"{', '.join(map(str, saved))}), or delete {source.path} and write {saved[-1]} into "
                             f"{os.path.join(root, TRACKER)}") from None


def load_checkpoint(config: CheckpointConfig, record: RunRecord, trainer,
                    log: Optional[Callable[[str], None]] = None) -> Optional[int]:
    """Collective. Restores weights (and optimizer, schedule, progress, RNG unless told not to)
    from the checkpoint `checkpoint_sources.find_checkpoint` chooses; `log` gets a line saying which. A
    Megatron-LM torch_dist checkpoint (with --finetune) gives its weights only (megatron_lm_checkpoint.py)."""
    if is_megatron_lm_checkpoint(config.load):
        recorded = load_megatron_lm_model(unwrap(trainer.model), config.load)
        if log is not None:
            log(f"> loaded the weights of Megatron-LM's checkpoint {config.load} (iteration "
                f"{getattr(recorded, 'iteration', '?')}); --finetune: training starts at iteration 0")
        return 0
    source = find_checkpoint(config, record)
    if source is None:
        return None
    metadata = read_checkpoint_metadata(source.path)
    _check_compatible(record, config.finetune, metadata, source.path)
    load_optim = not (config.no_load_optim or config.finetune)
    sharded = model_sharded_state_dict(unwrap(trainer.model))
    if load_optim:
        for part in local_optimizers(trainer.optimizer):
            _initialise_adam_state(part, metadata["adam_step"])
        sharded.update(_optimizer_sharded_state(trainer.model, trainer.optimizer))
    if source.kind == LOCAL:
        load_local(sharded, source)
    else:
        with _naming_earlier_iterations(source):
            _serialization().load(sharded, source.path)
    if log is not None:
        restart = "; --finetune: training starts at iteration 0" if config.finetune else ""
        log(f"> loaded {config.load} at iteration {source.iteration}{describe(source, config)}{restart}")
    if config.finetune:
        return 0
    if load_optim:
        trainer.scheduler.load_state_dict(metadata["scheduler"], override=config.override_opt_param_scheduler)
        if metadata.get("grad_scaler") and trainer.grad_scaler.is_enabled():
            trainer.grad_scaler.load_state_dict(metadata["grad_scaler"])
            if metadata.get("loss_scale"):
                trainer.loss_scale.load_state_dict(metadata["loss_scale"])
    trainer.state = type(trainer.state)(**metadata["train_state"])
    rank = global_rank()
    rng_path = source.rng_path(rank)
    # A rank's RNG streams belong to its place in the layout: restored only where that place is the
    # same (older checkpoints record no pipeline size: one stage). A checkpoint saved with
    # --no-save-rng has none: this run keeps its own.
    layout = metadata["layout"]
    same_layout = all(layout.get(name, 1) == getattr(record, name) for name in (
        "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"))
    if not config.no_load_rng and same_layout and os.path.exists(rng_path):
        restore_rng_state(trainer.model, torch.load(rng_path, weights_only=True))
    load_precision_state(trainer, source.fp8_path(rank), log or print)
    return source.iteration


def _initialise_adam_state(optimizer, step: float) -> None:
    """Create the state tensors the checkpoint is read into (AdamW creates them lazily), in the dtypes
    the optimizer keeps its moments in (bf16 under the precision-aware optimizer, CompiledAdamW)."""
    dtypes = getattr(optimizer, "moment_dtypes", {})
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=param.device if on_device else "cpu")
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param, dtype=dtypes.get(key) or param.dtype,
                                              memory_format=torch.preserve_format)


def _check_compatible(record: RunRecord, finetune: bool, metadata: dict, source: str) -> None:
    if metadata.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{source}: checkpoint format {metadata.get('format_version')} is not {FORMAT_VERSION}")
    check_compatible(record, finetune, metadata, source)
