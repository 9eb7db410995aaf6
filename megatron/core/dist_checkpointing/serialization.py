"""Save and load sharded state dicts with torch.distributed.checkpoint (DCP), resharding freely.

Every rank describes its tensors as `ShardedTensor` boxes of layout-independent global
tensors (`MegatronModule.sharded_state_dict`). Here each key becomes a torch
`ShardedTensor` holding this rank's boxes; DCP writes each box once (identical boxes of
replicas are de-duplicated) and, on load, reads whatever stored chunks overlap the boxes a
rank asks for. A checkpoint written under one tensor-parallel layout therefore loads under
any other, into the model's own tensors, in place.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.safe_reader import (CheckpointMetadataError, DamagedCheckpointError,
                                                           SafeFileSystemReader, check_shard_files)

Box = List[Tuple[int, int]]


def _subtract(region: Box, box: Box) -> List[Box]:
    """`region` minus `box` as disjoint boxes (at most two per dimension)."""
    overlap = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(region, box)]
    if any(low >= high for low, high in overlap):
        return [region]
    pieces, rest = [], list(region)
    for dim, (low, high) in enumerate(overlap):
        start, stop = rest[dim]
        if start < low:
            pieces.append(rest[:dim] + [(start, low)] + rest[dim + 1:])
        if high < stop:
            pieces.append(rest[:dim] + [(high, stop)] + rest[dim + 1:])
        rest[dim] = (low, high)
    return pieces


def _torch_sharded(pieces: Sequence[ShardedTensor], rank: int, world: int) -> TorchShardedTensor:
    """This rank's boxes of one global tensor as a torch ShardedTensor.

    torch insists that a ShardedTensor's metadata cover the whole tensor; the parts this rank
    does not hold are described as belonging to another rank (never read or written here).
    """
    device = pieces[0].data.device
    placement = f"rank:{rank}/{device.type}" if device.type == "cpu" else f"rank:{rank}/{device}"
    shards = [Shard(piece.data, ShardMetadata(list(piece.global_offset), list(piece.data.shape), placement))
              for piece in pieces]
    regions = [[(0, size) for size in pieces[0].global_shape]]
    for piece in pieces:
        box = [(o, o + n) for o, n in zip(piece.global_offset, piece.data.shape)]
        regions = [part for region in regions for part in _subtract(region, box)]
    elsewhere = f"rank:{(rank + 1) % world}/{device.type}"
    fillers = [ShardMetadata([a for a, _ in region], [b - a for a, b in region], elsewhere) for region in regions]
    metadata = ShardedTensorMetadata([shard.metadata for shard in shards] + fillers,
                                     torch.Size(pieces[0].global_shape),
                                     TensorProperties(dtype=pieces[0].data.dtype))
    return TorchShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def to_dcp_state_dict(sharded: Dict[str, ShardedTensor]) -> Dict[str, object]:
    """Group the boxes by checkpoint key; whole tensors stay plain (replicas de-duplicated)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_key: Dict[str, List[ShardedTensor]] = defaultdict(list)
    for piece in sharded.values():
        by_key[piece.key].append(piece)
    state = {}
    for key, pieces in by_key.items():
        shapes = {tuple(p.global_shape) for p in pieces}
        if len(shapes) != 1:
            raise ValueError(f"{key}: pieces disagree on the global shape {sorted(shapes)}")
        whole = len(pieces) == 1 and tuple(pieces[0].data.shape) == tuple(pieces[0].global_shape)
        state[key] = pieces[0].data if whole else _torch_sharded(pieces, rank, world)
    return state


# Files each rank writes in parallel: one writer thread left a ~1B model's save disk-latency bound.
WRITER_THREADS = 4


class _CheckedWriter(dcp.FileSystemWriter):
    """DCP's file-system writer, where a file that fails to write (a full disk) fails the save.

    DCP writes files in WRITER_THREADS threads; in a helper thread an error only ends that thread,
    printing its traceback, and the save goes on without that file's entries: the index would then
    be written for a checkpoint missing tensors. Here, while `write_data` runs, every file's stream
    records its error and stops (no traceback from the thread), and `write_data` raises the first one
    once all are done. Elsewhere (the index `finish` writes) a stream's error propagates as it is.
    """

    def __init__(self, checkpoint_dir: str) -> None:
        super().__init__(checkpoint_dir, thread_count=WRITER_THREADS)
        self.failures: Optional[List[Exception]] = None
        """The errors of the files `write_data` is writing; None outside it."""
        self.fs.create_stream = partial(_RecordedStream, self.fs.create_stream, self)

    def write_data(self, plan, planner):
        self.failures = []
        try:
            written = super().write_data(plan, planner)
        finally:
            failures, self.failures = self.failures, None
        if failures:
            raise failures[0]
        return written


class _RecordedStream:
    """`open_stream(path, mode)` as a context; while `writer.failures` is a list (inside write_data), the
    body's error is recorded there and swallowed: the thread writing it moves on (and fails fast on a
    full disk) instead of dying."""

    def __init__(self, open_stream: Callable, writer: _CheckedWriter, path, mode: str) -> None:
        self.context, self.failures = open_stream(path, mode), writer.failures

    def __enter__(self):
        try:
            return self.context.__enter__()
        except Exception as error:
            if self.failures is not None:
                self.failures.append(error)
            raise

    def __exit__(self, kind, error, trace) -> bool:
        self.context.__exit__(kind, error, trace)
        if isinstance(error, Exception) and self.failures is not None:
            self.failures.append(error)
            return True
        return False


def _writer(checkpoint_dir: str) -> dcp.FileSystemWriter:
    return _CheckedWriter(checkpoint_dir)


def _planner(fully_parallel: bool, cache_plan: bool) -> DefaultSavePlanner:
    """DCP writes a box several ranks hold (replicas) once: by default from the rank with the
    fewest bytes planned so far (writes spread over the replicas: Megatron's fully parallel
    save), with `fully_parallel=False` from the lowest rank holding it. `cache_plan`: the
    structure is the same at every save, so the plan is exchanged once and reused."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=not fully_parallel, enable_plan_caching=cache_plan)


def save(sharded: Dict[str, ShardedTensor], checkpoint_dir: str, fully_parallel: bool = True,
         cache_plan: bool = False) -> None:
    """Collective: every rank calls it with its own boxes."""
    dcp.save(to_dcp_state_dict(sharded), storage_writer=_writer(checkpoint_dir),
             planner=_planner(fully_parallel, cache_plan))


class _HostStaging:
    """Host copies of the pieces for the background writer. Pinned buffers are slow to
    allocate, so they are kept and reused by the next save, once the previous write finished."""

    def __init__(self) -> None:
        self.buffers: Dict[str, torch.Tensor] = {}
        self.writing: Future | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

    def _buffer(self, name: str, data: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
            buffer = torch.empty(data.shape, dtype=data.dtype, pin_memory=data.is_cuda)
            self.buffers[name] = buffer
        return buffer

    def stage(self, sharded: Dict[str, ShardedTensor]) -> Dict[str, ShardedTensor]:
        if self.writing is not None:
            self.writing.result()  # its buffers are about to be overwritten
        staged, on_gpu = {}, False
        for name, piece in sharded.items():
            on_gpu |= piece.data.is_cuda
            copy = self._buffer(name, piece.data)
            copy.copy_(piece.data, non_blocking=True)
            staged[name] = dataclasses.replace(piece, data=copy)
        if on_gpu:
            torch.cuda.synchronize()
        return staged

    def write(self, state: Dict[str, object], checkpoint_dir: str, process_group, planner) -> Future:
        self.writing = self.executor.submit(dcp.save, state, storage_writer=_writer(checkpoint_dir),
                                            process_group=process_group, planner=planner)
        return self.writing


_STAGING = _HostStaging()


def save_async(sharded: Dict[str, ShardedTensor], checkpoint_dir: str, process_group=None,
               fully_parallel: bool = True, cache_plan: bool = False) -> Future:
    """Collective: stage this rank's boxes to host memory, then write them in a background
    thread. The future completes when this rank's files are written (and, on the coordinating
    rank, the metadata). `process_group` carries DCP's collectives: give the writer a group of
    its own (gloo) so they never interleave with the training loop's."""
    state = to_dcp_state_dict(_STAGING.stage(sharded))
    return _STAGING.write(state, checkpoint_dir, process_group, _planner(fully_parallel, cache_plan))


def _fit_padded_rows(sharded: Dict[str, ShardedTensor], metadata) -> Dict[str, ShardedTensor]:
    """Vocabulary tensors saved with another padding: read the rows both layouts have."""
    fitted = {}
    for name, piece in sharded.items():
        stored = metadata.get(piece.key)
        if piece.padded_rows and stored is not None and tuple(stored.size)[1:] == tuple(piece.global_shape)[1:]:
            piece = piece.clipped_rows(stored.size[0])
        if piece is not None:
            fitted[name] = piece
    return fitted


def load(sharded: Dict[str, ShardedTensor], checkpoint_dir: str) -> None:
    """Collective: fill every rank's boxes, in place, from the checkpoint's chunks."""
    try:
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    except CheckpointMetadataError:
        raise
    except Exception as error:
        raise ValueError(f"checkpoint {checkpoint_dir} has no readable .metadata ({error}); "
                         "the save was interrupted or the directory is not a checkpoint") from error
    fitted = _fit_padded_rows(sharded, metadata)
    world = dist.get_world_size() if dist.is_initialized() else 1
    staged = {}
    if world == 1:
        # One process cannot describe part of a tensor to DCP: read such tensors whole, then copy.
        # (Several pieces of one tensor, as the stacked layers of a Megatron-LM checkpoint, share one read.)
        for name, piece in list(fitted.items()):
            if tuple(piece.data.shape) != tuple(piece.global_shape):
                if piece.key in staged:
                    del fitted[name]
                    continue
                buffer = staged[piece.key] = torch.empty(piece.global_shape, dtype=piece.data.dtype,
                                                         device=piece.data.device)
                fitted[name] = ShardedTensor.from_local(piece.key, buffer)
    state = to_dcp_state_dict(fitted)
    missing = sorted(set(state) - set(metadata))
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} has no tensor {missing[0]!r} "
                         f"({len(missing)} missing); is it a checkpoint of this model?")
    for key, value in state.items():
        stored = tuple(metadata[key].size)
        expected = tuple(value.size())
        if stored != expected:
            raise ValueError(f"checkpoint {checkpoint_dir}: tensor {key!r} has shape {stored}, this model "
                             f"expects {expected}; the architecture differs")
    check_shard_files(checkpoint_dir)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint_dir))
    except (Exception, CheckpointException) as error:  # DCP reports a damaged file deep inside its reader
        damaged = _damaged_file(error)
        if damaged is not None:  # every rank gathers every rank's failures: all of them raise it
            raise damaged from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"checkpoint {checkpoint_dir} could not be read ({type(error).__name__}: {first_line}): "
                         "a shard file is damaged or missing; load an earlier iteration") from error
    for name, piece in _fit_padded_rows(sharded, metadata).items():
        if piece.key in staged:
            box = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.data.shape))
            piece.data.copy_(staged[piece.key][box])


def _damaged_file(error: BaseException):
    """The DamagedCheckpointError among the ranks' failures DCP gathered into `error`, if any."""
    failures = error.failures.values() if isinstance(error, CheckpointException) else [(error, None)]
    for failure, _ in failures:
        if isinstance(failure, DamagedCheckpointError):
            return failure
    return None
