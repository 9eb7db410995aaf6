"""MegaDLMs training checkpoints outside the training loop: read them in one process, write new ones.

A checkpoint `DIR/iter_NNNNNNN/` holds torch.distributed.checkpoint (DCP) shards whose keys
(`model.<name>`) name layout-independent global tensors, whatever tensor-parallel layout wrote
them, plus `metadata.json` (configs, layout, tokenizer identity). So one process can read any
checkpoint tensor by tensor (`read_tensors`), or fill a single-process GPTModel with the
framework's own resharding loader (`load_model`).

Writing (`write_checkpoint`) produces what `pretrain_difflm.py --load` accepts. With
tensor_parallel=1 the global tensors are saved directly (one process, memory = one model).
A larger tensor_parallel spawns that many gloo processes on CPU, each building the TP-sharded
GPTModel and saving its own slices through the framework's save path, so the files are exactly
those of a TP=N training run. Both load under any layout, since loading reshards. The new
iteration is written to a staging folder inside the save directory and renamed to
`iter_NNNNNNN/` once complete; the tracker is written (atomically) after that. So a failure or a
kill at any moment leaves no tracker naming an incomplete iteration, and an existing iteration
is never written over.

Bad checkpoints (a tracker naming a missing iteration, no or unreadable metadata.json, a
missing or truncated shard) raise `CheckpointError`, an `InputError` naming the file and the fix.
Finding and checking the checkpoint a --load names (`resolve_checkpoint`, `read_metadata`,
`check_shard_files`, `inference_metadata`) is megatron/training/checkpoint_files.py's: the
evaluation reads checkpoints too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import warnings
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.checkpoint_files import (FORMAT_VERSION, TRACKER, CheckpointError, check_shard_files,
                                                configs_from_metadata, dcp_index, install_checkpoint, iteration_dir,
                                                latest_iteration, read_metadata, resolve_checkpoint, write_tracker)
from megatron.training.tokenizer import vocab_size_with_padding

MODEL_PREFIX = "model."


def stored_shapes(iter_dir: str) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """{model tensor name (without `model.`): (global shape, dtype)} of a checkpoint."""
    metadata = dcp_index(iter_dir).state_dict_metadata
    shapes = {}
    for key, item in metadata.items():
        if key.startswith(MODEL_PREFIX) and hasattr(item, "size"):
            shapes[key[len(MODEL_PREFIX):]] = (tuple(item.size), item.properties.dtype)
    return shapes


def read_tensors(iter_dir: str, names: Iterable[str], shapes=None) -> Dict[str, torch.Tensor]:
    """Whole global tensors `names` (without `model.`) read in this process, however they were sharded."""
    shapes = shapes or stored_shapes(iter_dir)
    missing = [name for name in names if name not in shapes]
    if missing:
        raise CheckpointError(f"{iter_dir} has no tensor model.{missing[0]} ({len(missing)} missing); "
                              "is it a checkpoint of this architecture?")
    state = {MODEL_PREFIX + name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
    try:
        with warnings.catch_warnings():  # DCP notes that it runs without a process group: intended
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=SafeFileSystemReader(iter_dir))
    except (Exception, dcp.api.CheckpointException) as error:  # DCP's error for a damaged file is not an Exception
        raise CheckpointError(f"{iter_dir} could not be read ({type(error).__name__}): a shard file is damaged; "
                              "copy it again or load an earlier iteration") from None
    return {name[len(MODEL_PREFIX):]: tensor for name, tensor in state.items()}


def load_model(load: str, iteration: Optional[int] = None):
    """(fp32 single-process GPTModel in eval mode, metadata, iter directory) of a checkpoint of any layout."""
    from megatron.core.models.difflm.gpt_model import GPTModel

    iter_dir, _ = resolve_checkpoint(load, iteration)
    metadata = read_metadata(iter_dir)
    check_shard_files(iter_dir)
    config, dlm = configs_from_metadata(metadata)
    with torch.device("meta"):  # no random init of weights that are read next
        model = GPTModel(config, dlm)
    model.to_empty(device="cpu")
    for module in model.modules():  # the only state not in a checkpoint: tables derived from the config
        if isinstance(module, RotaryEmbedding):
            for name, table in RotaryEmbedding(config).named_buffers():
                getattr(module, name).copy_(table)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        serialization.load(model.sharded_state_dict(prefix=MODEL_PREFIX), iter_dir)
    return model.eval(), metadata, iter_dir


# ---------------------------------------------------------------------- writing
def metadata_for(config: TransformerConfig, dlm: DLMConfig, tensor_parallel: int, tokenizer: Optional[dict],
                 seq_length: Optional[int], source: dict, iteration: int = 0) -> dict:
    """metadata.json of a converted checkpoint: the fields training writes, iteration 0, no optimizer."""
    from megatron.training.step_state import TrainState

    saved = {key: str(value) if isinstance(value, torch.dtype) else value
             for key, value in dataclasses.asdict(config).items()}
    return {"format_version": FORMAT_VERSION, "iteration": iteration,
            "train_state": dataclasses.asdict(TrainState(iteration=iteration)), "scheduler": None, "adam_step": 0,
            "transformer_config": saved, "dlm_config": dataclasses.asdict(dlm),
            "layout": {"world_size": tensor_parallel, "tensor_model_parallel_size": tensor_parallel,
                       "data_parallel_size": 1},
            "tokenizer": tokenizer, "seq_length": seq_length, "converted_from": source}


def padded_config(config: TransformerConfig, tensor_parallel: int, divisible_by: int) -> TransformerConfig:
    """The config a TP=N training run would build: vocabulary padded to a multiple of divisible_by * N."""
    vocab = config.unpadded_vocab_size or config.vocab_size
    return config.replace(vocab_size=vocab_size_with_padding(vocab, divisible_by, tensor_parallel),
                          unpadded_vocab_size=vocab)


def check_save_target(save: str, iteration: int) -> None:
    """Refuse, before any weight is read, a --save where writing `iteration` would overwrite a checkpoint
    or repoint the tracker of a training run's later iterations."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(f"--save {save} is a file; choose a directory")
    target = iteration_dir(save, iteration)
    if os.path.isdir(target) and os.listdir(target):
        raise CheckpointError(f"--save {save} already holds iteration {iteration} ({target}); choose another "
                              "--save directory or remove it")
    latest = latest_iteration(save, missing_ok=True) if os.path.isdir(save) else None
    if latest is not None and latest != iteration and os.path.isdir(iteration_dir(save, latest)):
        raise CheckpointError(f"--save {save} holds a checkpoint ({TRACKER} names iteration {latest}) that this "
                              "one would replace as the latest; choose an empty --save directory")


def _write_staged(staging: str, tensors: Dict[str, torch.Tensor], metadata: dict, tensor_parallel: int) -> None:
    whole = staging if tensor_parallel == 1 else staging + "-tp1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({MODEL_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()},
                     checkpoint_id=whole)
        if tensor_parallel > 1:
            reshard_with_processes(whole, staging, metadata, tensor_parallel)
    finally:
        if whole != staging:
            shutil.rmtree(whole, ignore_errors=True)
    with open(os.path.join(staging, "metadata.json"), "w") as handle:
        json.dump(metadata, handle, indent=1)


def write_checkpoint(save: str, tensors: Dict[str, torch.Tensor], metadata: dict, tensor_parallel: int = 1) -> str:
    """Write `tensors` (our names, global shapes) as iteration `metadata['iteration']` of `save`: staged
    in a hidden folder of `save`, renamed into place when complete, the tracker last."""
    iteration = metadata["iteration"]
    check_save_target(save, iteration)
    created = not os.path.isdir(save)
    os.makedirs(save, exist_ok=True)
    staging = os.path.join(save, f".tmp-iter_{iteration:07d}-{os.getpid()}")  # not iter_*: training skips it
    try:
        _write_staged(staging, tensors, metadata, tensor_parallel)
        target = install_checkpoint(save, iteration, staging)  # renames; training's own way in
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.listdir(save):
            os.rmdir(save)
        raise
    write_tracker(save, iteration)
    return target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reshard_with_processes(source: str, target: str, metadata: dict, tensor_parallel: int) -> None:
    """Load `source` into a TP=`tensor_parallel` GPTModel in as many gloo processes and save it to `target`."""
    import torch.multiprocessing as mp

    mp.start_processes(_reshard_worker, args=(tensor_parallel, _free_port(), source, target, metadata),
                       nprocs=tensor_parallel, join=True, start_method="spawn")


def _reshard_worker(rank: int, world_size: int, port: int, source: str, target: str, metadata: dict) -> None:
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.core.parallel_state import initialize_model_parallel

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # DCP's notes about ShardedTensor deprecation, once per process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        state = initialize_model_parallel(world_size)
        base, dlm = configs_from_metadata(metadata)
        saved = metadata["transformer_config"]
        # MoE layers under tensor parallelism need sequence parallelism (which changes no stored shape).
        config = base.replace(vocab_size=saved["vocab_size"], sequence_parallel=base.moe is not None)
        with torch.device("meta"):  # no random init: every weight is read from `source`
            model = GPTModel(config, dlm, pg=state.groups)
        model.to_empty(device="cpu")
        with torch.no_grad():  # vocabulary padding rows are not in `source`: zeros, never NaN
            for param in model.parameters():
                param.zero_()
        pieces = model.sharded_state_dict(prefix=MODEL_PREFIX)
        serialization.load(pieces, source)
        serialization.save(pieces, target)
        dist.barrier()
    finally:
        dist.destroy_process_group()
