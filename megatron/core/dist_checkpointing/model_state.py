"""The checkpoint pieces of a (possibly FSDP2-sharded) model and of its optimizer state.

Modules describe each parameter as boxes of layout-independent global tensors
(`MegatronModule.sharded_state_dict`), always as a reshaped view of the whole parameter
of their tensor-parallel rank. Two things build on that description here:

- FSDP2 (`--data-parallel-sharding-strategy optim_grads[_params]`) splits every parameter
  again, by rows of dim 0 over the data-parallel ranks, into a DTensor. The description is
  taken on a meta placeholder of the full parameter, then each box is cut to the rows this
  rank holds: a contiguous range of elements, which is a handful of smaller boxes.
- The optimizer state of a parameter has the parameter's shape (and sharding), so it is
  described with the parameter's own boxes under another key.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from megatron.core.dist_checkpointing.mapping import ShardedTensor

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape)
ParameterPieces = List[Tuple[torch.Tensor, ShardedTensor]]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def _storage_key(tensor: torch.Tensor) -> Tuple[int, int]:
    return tensor.untyped_storage()._cdata, tensor.storage_offset()


@contextmanager
def _placeholders(model: nn.Module) -> Iterator[Dict[int, torch.Tensor]]:
    """FSDP2's DTensor parameters swapped for meta tensors of their full shape while the model
    describes itself (DTensors cannot be viewed the way the descriptions do). Yields
    {storage of a placeholder: the parameter it stands for}."""
    swapped, by_storage = [], {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and _is_dtensor(param):
                placeholder = torch.empty(param.shape, dtype=param.dtype, device="meta")
                module._parameters[name] = placeholder
                swapped.append((module, name, param))
                by_storage[placeholder.untyped_storage()._cdata] = param
    try:
        yield by_storage
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def parameter_pieces(model: nn.Module, prefix: str = "model.") -> Tuple[ParameterPieces, Dict[str, ShardedTensor]]:
    """(parameter, piece describing it) pairs, and the pieces that are not parameters."""
    params = {_storage_key(p): p for p in model.parameters() if not _is_dtensor(p)}
    with _placeholders(model) as sharded_params:
        sharded = model.sharded_state_dict(prefix=prefix)
    pairs, others = [], {}
    for name, piece in sharded.items():
        param = sharded_params.get(piece.data.untyped_storage()._cdata)
        if param is None:
            param = params.get(_storage_key(piece.data))
        if param is None:
            others[name] = piece
            continue
        if piece.data.numel() != param.numel() or not piece.data.is_contiguous():
            raise ValueError(f"{piece.key}: a checkpoint piece must view its whole parameter "
                             f"({tuple(piece.data.shape)} of {tuple(param.shape)})")
        pairs.append((param, piece))
    return pairs, others


def linear_range_boxes(shape: Tuple[int, ...], start: int, stop: int) -> List[Box]:
    """Elements [start, stop) of a row-major tensor of `shape` as disjoint boxes, in order."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:  # whole rows
        return [((first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
    if first == last:
        return [((first, *offset), (1, *size))
                for offset, size in linear_range_boxes(shape[1:], start - first * inner, stop - first * inner)]
    head_stop = (first + 1) * inner
    tail_start = last * inner
    return (linear_range_boxes(shape, start, head_stop) + linear_range_boxes(shape, head_stop, tail_start)
            + linear_range_boxes(shape, tail_start, stop))


def _local_rows(tensor: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The rows of dim 0 this rank holds of an FSDP2 DTensor, and the index of the first. Under
    HSDP (distributed-optimizer instances) the mesh is [replicate, shard]: the replicas describe
    the same rows, which the writer stores once."""
    placements = tensor.placements
    sharded = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(0):
        raise ValueError(f"checkpointing supports FSDP2 parameters sharded on dim 0 only, not {placements}")
    local = tensor.to_local()
    mesh, dim = tensor.device_mesh, sharded[0]
    chunk = -(-tensor.shape[0] // mesh.size(dim))  # FSDP2 splits rows as torch.chunk does
    first = min(mesh.get_local_rank(dim) * chunk, tensor.shape[0])
    if local.shape[0] != max(0, min(chunk, tensor.shape[0] - first)):
        raise ValueError(f"unexpected FSDP2 shard of {local.shape[0]} rows at row {first} of {tuple(tensor.shape)}")
    return local, first


def bind(piece: ShardedTensor, tensor: torch.Tensor, key: str = None) -> List[ShardedTensor]:
    """`piece` (a description of a parameter) filled with `tensor` of the parameter's shape,
    under `key`: one piece, or under FSDP2 the boxes of the rows this rank holds."""
    key = key or piece.key
    if not _is_dtensor(tensor):
        return [dataclasses.replace(piece, key=key, data=tensor.detach().view(piece.data.shape))]
    local, first_row = _local_rows(tensor)
    row_numel = math.prod(tensor.shape[1:])
    flat = local.detach().reshape(-1)
    start = first_row * row_numel
    bound = []
    for offset, size in linear_range_boxes(tuple(piece.data.shape), start, start + flat.numel()):
        begin = sum(o * math.prod(piece.data.shape[d + 1:]) for d, o in enumerate(offset)) - start
        data = flat[begin:begin + math.prod(size)].view(size)
        global_offset = tuple(g + o for g, o in zip(piece.global_offset, offset))
        bound.append(dataclasses.replace(piece, key=key, data=data, global_offset=global_offset))
    return bound


def _add(sharded: Dict[str, ShardedTensor], pieces: List[ShardedTensor]) -> None:
    for piece in pieces:
        sharded[f"{piece.key}@{piece.global_offset}"] = piece


def model_sharded_state_dict(model: nn.Module, prefix: str = "model.") -> Dict[str, ShardedTensor]:
    """The model's checkpoint pieces on this rank (FSDP2 shards included)."""
    pairs, sharded = parameter_pieces(model, prefix)
    for param, piece in pairs:
        _add(sharded, bind(piece, param))
    return sharded


def optimizer_sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, fields=("exp_avg", "exp_avg_sq"),
                                 prefix: str = "model.") -> Dict[str, ShardedTensor]:
    """Per-parameter optimizer state (`optimizer.<field>.<parameter key>`) with the parameter's
    boxes. A rank describes the parameters it has state for: all of them, or under ZeRO-1
    the ones it owns."""
    sharded = {}
    pairs, _ = parameter_pieces(model, prefix)
    for param, piece in pairs:
        state = optimizer.state.get(param)
        if not state:
            continue
        for field in fields:
            _add(sharded, bind(piece, state[field], key=f"optimizer.{field}.{piece.key[len(prefix):]}"))
    return sharded
