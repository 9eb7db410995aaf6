"""The files of a `--save` directory and how they are found, written and checked: the iteration
folders, the tracker, metadata.json and each rank's precision state (fp8 scaling) file (checkpointing.py's docstring
draws the layout).

Training (checkpointing.py), the non-persistent checkpoints (checkpoint_sources.py), the flags
read back from a checkpoint (checkpoint_args.py), the evaluation and the conversion tools all
build on this module, and it on none of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

import megatron
from megatron.core.errors import InputError
from megatron.core.transformer.moe.config import MoEConfig
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.configs import RunRecord

FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
FP8_DIR = "fp8"
STAGING_SUFFIX, REPLACED_SUFFIX = ".tmp", ".replaced"


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------- iteration folders
def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_dir(root: str, iteration: int) -> str:
    """Where iteration N of `root` is: `iter_N/`, or `iter_N.replaced/` when a save that
    rewrote iteration N died between its two renames (the tracker still names N)."""
    final = checkpoint_dir(root, iteration)
    aside = final + REPLACED_SUFFIX
    return aside if not os.path.isdir(final) and os.path.isdir(aside) else final


def install_checkpoint(root: str, iteration: int, staged: str) -> str:
    """Rename the complete `staged` directory into place as iteration N (one process only)."""
    final = checkpoint_dir(root, iteration)
    aside = final + REPLACED_SUFFIX
    if os.path.isdir(aside):  # left by an earlier crash: is it still the only copy of N?
        if os.path.isdir(final):
            shutil.rmtree(aside)
        else:
            os.rename(aside, final)
    if os.path.isdir(final):
        os.rename(final, aside)
    os.rename(staged, final)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def _fsync_dir(path: str) -> None:
    """Make the renames in `path` durable before the tracker names them."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def remove_old_checkpoints(root: str, keep: Optional[int], saved: int) -> None:
    """--keep-last-checkpoints: of the iterations up to the one just saved, keep the newest `keep`.
    Newer iterations (another run's, in a shared directory) are never touched."""
    if not keep:
        return
    iterations = sorted(int(name[5:]) for name in os.listdir(root) if name.startswith("iter_") and name[5:].isdigit())
    older = [iteration for iteration in iterations if iteration <= saved]
    for iteration in older[:-keep]:
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)


# ---------------------------------------------------------------------- the tracker
def write_tracker(root: str, iteration: int) -> None:
    """Write to a temporary name, fsync, rename: a crash leaves the old tracker or the new one."""
    temporary = os.path.join(root, TRACKER + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(root, TRACKER))


def latest_iteration(root: str, missing_ok: bool = False) -> Optional[int]:
    """The tracker's iteration (None without a tracker). The directory it names must exist,
    unless `missing_ok` (a save checking the tracker before moving it)."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise InputError(f"{path} holds {text!r}, not an iteration number; write the number of a saved "
                         "iteration into it, or remove it to start from scratch")
    iteration = int(text)
    if not missing_ok and not os.path.isdir(iteration_dir(root, iteration)):
        raise InputError(f"{path} names iteration {iteration}, but {checkpoint_dir(root, iteration)} does not "
                         f"exist; write the number of an iteration that {root} holds into it")
    return iteration


# ---------------------------------------------------------------------- metadata.json
def checkpoint_metadata(record: RunRecord, trainer, iteration: int) -> dict:
    """What a training save writes into metadata.json."""
    return {"format_version": FORMAT_VERSION, "iteration": iteration,
            "framework": {"megadlms": megatron.__version__, "torch": torch.__version__},
            "train_state": dataclasses.asdict(trainer.state), "scheduler": trainer.scheduler.state_dict(),
            "adam_step": trainer.scheduler.num_updates,  # applied updates (num_steps may count samples)
            "transformer_config": {k: str(v) if isinstance(v, torch.dtype) else v
                                   for k, v in dataclasses.asdict(record.transformer_config).items()},
            # Under a block-size curriculum, the size the checkpoint ends at: what sampling and export use.
            "dlm_config": dataclasses.asdict(record.dlm_config.at_iteration(max(iteration - 1, 0))),
            "layout": {"world_size": record.world_size,
                       "tensor_model_parallel_size": record.tensor_model_parallel_size,
                       "data_parallel_size": record.data_parallel_size,
                       "pipeline_model_parallel_size": record.pipeline_model_parallel_size,
                       "virtual_pipeline_model_parallel_size": record.virtual_pipeline_model_parallel_size},
            "tokenizer": record.tokenizer, "seq_length": record.seq_length,
            # fp16's dynamic loss scale: a resumed run continues with the scale it had reached.
            "grad_scaler": trainer.grad_scaler.state_dict() if trainer.grad_scaler.is_enabled() else None,
            "loss_scale": trainer.loss_scale.state_dict() if trainer.grad_scaler.is_enabled() else None}


def read_checkpoint_metadata(source: str) -> dict:
    """metadata.json of the iteration directory `source`, checked to be this format's."""
    path = os.path.join(source, "metadata.json")
    try:
        with open(path) as handle:
            metadata = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"{path} does not exist: {source} is not a complete checkpoint; point the tracker "
                         "at another iteration or load another directory") from None
    except (OSError, ValueError) as error:
        raise InputError(f"{path} is not readable JSON ({error}); the checkpoint is damaged: load another "
                         "iteration") from None
    if not isinstance(metadata, dict) or metadata.get("format_version") != FORMAT_VERSION:
        version = metadata.get("format_version") if isinstance(metadata, dict) else None
        raise InputError(f"{source}: checkpoint format {version} is not {FORMAT_VERSION}; convert it or load "
                         "one written by this version")
    return metadata


# ---------------------------------------------------------------------- the precision converter's state
def save_precision_state(trainer, path: str) -> None:
    """This rank's state of the precision converter (`WeightCopies.state_dict`: `--fp8-recipe delayed`'s
    amax histories and scales, tensors and layer names only); nothing where it keeps none."""
    copies = getattr(trainer, "weight_copies", None)
    state = None if copies is None else copies.state_dict()
    if state is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)


def load_precision_state(trainer, path: str, log: Callable[[str], None]) -> None:
    """The state saved for this rank, where it fits this run; else the converter starts afresh (delayed
    scaling's first iteration scales by each tensor's own amax), said in one line."""
    copies = getattr(trainer, "weight_copies", None)
    if copies is None or not copies.has_state:
        return
    problem = "the checkpoint has none for this rank (saved without --fp8-recipe delayed, or by another layout)"
    if os.path.exists(path):
        try:
            problem = copies.load_state_dict(torch.load(path, weights_only=True))
        except (RuntimeError, OSError, KeyError, TypeError, pickle.UnpicklingError) as error:
            raise InputError(f"{path} cannot be read ({str(error).splitlines()[0][:200]}); delete it and the "
                             "run starts its fp8 amax histories afresh") from None
    if problem is not None and global_rank() == 0:
        log(f"> --fp8-recipe delayed: amax histories start afresh: {problem}")


# ---------------------------------------------------------------------- a checkpoint named by the user
class CheckpointError(InputError):
    """A checkpoint outside training (--load of a tool, lm-eval's load=) that cannot be read."""


def resolve_checkpoint(load: str, iteration: Optional[int] = None) -> Tuple[str, int]:
    """(iter directory, iteration) of `load`: a save directory (latest or `iteration`) or an iter_ directory."""
    if not os.path.isdir(load):
        raise CheckpointError(f"--load {load} does not exist or is not a directory; pass the --save directory "
                              "of a training run")
    if os.path.isfile(os.path.join(load, "metadata.json")):
        with open(os.path.join(load, "metadata.json")) as handle:
            return load, int(json.load(handle).get("iteration", 0))
    if iteration is None:
        iteration = latest_iteration(load)  # which also refuses a tracker naming a missing iteration
        if iteration is None:
            raise CheckpointError(f"{load} has no {TRACKER} and no metadata.json: pass a checkpoint directory "
                                  "written by --save (or one of its iter_NNNNNNN folders), or --iteration N")
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"--iteration {iteration}: {path} does not exist; pass an iteration that {load} holds")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"{path}/metadata.json is missing, so {path} is incomplete (an interrupted save or "
                              f"copy); copy it again, or write an earlier complete iteration into {TRACKER}")
    return path, iteration


def read_metadata(iter_dir: str) -> dict:
    """metadata.json of a MegaDLMs model checkpoint (read_checkpoint_metadata, with its model config)."""
    metadata = read_checkpoint_metadata(iter_dir)  # readable JSON of this format, or an InputError
    if not isinstance(metadata.get("transformer_config"), dict):
        raise CheckpointError(f"{iter_dir}/metadata.json has no transformer_config; it is not the metadata of a "
                              "MegaDLMs checkpoint")
    return metadata


def inference_metadata(load: str) -> dict:
    """metadata.json of the checkpoint `load_inference_model(load)` reads (the tracker's iteration),
    with its shard files checked, so a bad --load is one clear error before any model is built."""
    if os.path.isdir(load) and latest_iteration(load) is None:
        raise CheckpointError(f"--load {load} has no {TRACKER}; point it at the --save directory of a training run")
    iter_dir, _ = resolve_checkpoint(load)
    metadata = read_metadata(iter_dir)
    check_shard_files(iter_dir)
    return metadata


def dcp_index(iter_dir: str):
    """DCP's index (`.metadata`) of a checkpoint, read without executing code from it."""
    from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader  # DCP: ~1.3 s to import

    if not os.path.isfile(os.path.join(iter_dir, ".metadata")):
        raise CheckpointError(f"{iter_dir}/.metadata is missing: the save was interrupted or the copy is "
                              "incomplete; load an earlier iteration")
    return SafeFileSystemReader(iter_dir).read_metadata()


def check_shard_files(iter_dir: str) -> None:
    """Fail before any tensor is read when a shard file the index names is missing or shorter than the
    index says (a truncated copy); damage inside a file is found when it is read."""
    from megatron.core.dist_checkpointing import safe_reader  # DCP: ~1.3 s to import

    dcp_index(iter_dir)  # a missing index is named as such
    try:
        safe_reader.check_shard_files(iter_dir)
    except safe_reader.DamagedCheckpointError as error:
        raise error.with_fix("copy it again or load an earlier iteration") from None


def _known_fields(cls, values: dict) -> dict:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in values.items() if key in names}


def configs_from_metadata(metadata: dict) -> Tuple[TransformerConfig, DLMConfig]:
    """The model's configs for one fp32 process: no parallelism, the unpadded vocabulary. Fields a
    config no longer has (an earlier release's parallel sizes or removed levers) are dropped."""
    saved = _known_fields(TransformerConfig, metadata["transformer_config"])
    vocab = saved.get("unpadded_vocab_size") or saved["vocab_size"]
    if isinstance(saved.get("moe"), dict):  # metadata.json holds the MoEConfig as a dict
        saved["moe"] = MoEConfig(**{key: value for key, value in _known_fields(MoEConfig, saved["moe"]).items()
                                    if key != "layer_flags"})  # derived again from layer_freq
    config = TransformerConfig(**{**saved, "params_dtype": torch.float32, "bf16": False, "fp16": False,
                                  "vocab_size": vocab, "unpadded_vocab_size": vocab,
                                  "sequence_parallel": False, "recompute_granularity": None,
                                  "recompute_method": None, "recompute_num_layers": None})
    dlm = DLMConfig(**_known_fields(DLMConfig, metadata.get("dlm_config") or {"model_running_mode": "vanilla"}))
    return config, dlm
