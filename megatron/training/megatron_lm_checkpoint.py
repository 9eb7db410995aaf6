"""Read a Megatron-LM / MegaDLMs GPT checkpoint in the `torch_dist` format (megatron-core's
`dist_checkpointing`) without running code from it: its flags and its weights under our names.

The folder: `latest_checkpointed_iteration.txt` and `iter_NNNNNNN/` holding `metadata.json`
(`"sharded_backend": "torch_dist"`), DCP's `.metadata` and shards, and `common.pt` (a torch pickle of
the run's `args` Namespace and a few numbers). `common.pt` is read with torch's weights-only unpickler
allowing argparse.Namespace besides tensors and builtins; `.metadata` with the DCP allow-list reader
(safe_reader.py). megatron-core writes the decoder's layers stacked along a leading dimension under
Transformer Engine's names (`decoder.layers.self_attention.linear_qkv.layer_norm_weight` is the input
norm, `...mlp.linear_fc1.layer_norm_weight` the pre-MLP norm, also for its local layer spec), the QKV rows
grouped per query group (the queries of the group, then its key, then its value) and SwiGLU's fc1 as
[gate; up]: the layouts our layers use, so each tensor is renamed and split per layer, not reordered.
`_extra_state` entries (Transformer Engine's fp8 metadata) carry no weights and are skipped.

Each of our pieces (model_sharded_state_dict: its global shape and offset under our layout) is described as
its part of the checkpoint's tensor (a layer's piece is the slice [layer] of the stacked one), so the DCP
reader gives every rank only what it holds, whatever layout saved the checkpoint. So far: dense models.
`tests/assets/megatron/` holds checkpoints megatron-core wrote and the logits it computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pickle
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.errors import InputError
from megatron.training.checkpoint_files import TRACKER, iteration_dir

__all__ = ["is_megatron_lm_checkpoint", "megatron_lm_iteration_dir", "read_megatron_lm_args",
           "megatron_lm_architecture", "row_blocks", "megatron_lm_pieces", "load_megatron_lm_model"]

# megatron-core's stacked decoder keys -> ours per layer (`{}` the layer)
LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias": "pre_mlp_layernorm.bias",
}


def _tracked(root: str) -> Tuple[Optional[str], Optional[dict]]:
    """(the iteration folder the tracker under `root` names, its metadata.json) or Nones where unreadable."""
    try:
        with open(os.path.join(root, TRACKER)) as handle:
            text = handle.read().strip()
        folder = os.path.join(root, "release") if text == "release" else iteration_dir(root, int(text))
        with open(os.path.join(folder, "metadata.json")) as handle:
            metadata = json.load(handle)
    except (OSError, ValueError):
        return None, None
    return folder, metadata if isinstance(metadata, dict) else None


def megatron_lm_iteration_dir(root: str) -> str:
    """The iteration folder the tracker names (a `torch_dist` one), or InputError naming what is wrong."""
    folder, metadata = _tracked(root)
    backend = (metadata or {}).get("sharded_backend")
    if folder is None or backend != "torch_dist":
        raise InputError(f"--load {root}: not a Megatron-LM torch_dist checkpoint (no {TRACKER} naming an "
                         f"iteration whose metadata.json says torch_dist: {backend!r}); save it with "
                         "--ckpt-format torch_dist")
    return folder


def read_megatron_lm_args(folder: str) -> argparse.Namespace:
    """The `args` Namespace the run recorded in common.pt (weights-only unpickling)."""
    path = os.path.join(folder, "common.pt")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{path}: cannot be read safely ({first}); load a checkpoint you trust") from None
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise InputError(f"{path} holds no args Namespace: not a Megatron-LM checkpoint")
    return args


def is_megatron_lm_checkpoint(root: str) -> bool:
    """Whether the iteration the tracker under `root` names is a Megatron-LM torch_dist checkpoint (its
    metadata.json names a sharded backend and, unlike ours, no format version)."""
    _, metadata = _tracked(root)
    return metadata is not None and "sharded_backend" in metadata and "format_version" not in metadata


def megatron_lm_architecture(args: argparse.Namespace) -> Dict[str, object]:
    """Our flags' destinations for the architecture the Megatron-LM run recorded (the same flag names
    and meanings; --use-checkpoint-args sets them)."""
    if args.position_embedding_type not in ("rope",):
        raise InputError(f"the checkpoint's --position-embedding-type {args.position_embedding_type} is not one "
                         "this model has (rope); it cannot be loaded here")
    gqa = bool(getattr(args, "group_query_attention", False))
    return {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
            "num_attention_heads": args.num_attention_heads, "group_query_attention": gqa,
            "num_query_groups": args.num_query_groups if gqa else None,
            "kv_channels": getattr(args, "kv_channels", None), "normalization": args.normalization,
            "norm_epsilon": args.norm_epsilon, "swiglu": bool(args.swiglu),
            "qk_layernorm": bool(getattr(args, "qk_layernorm", False)),
            "disable_bias_linear": not args.add_bias_linear,
            "untie_embeddings_and_output_weights": bool(args.untie_embeddings_and_output_weights),
            "position_embedding_type": "rope", "rotary_base": int(getattr(args, "rotary_base", 10000)),
            "max_position_embeddings": args.max_position_embeddings}


def _megatron_key(key: str, index) -> Tuple[str, Optional[int]]:
    """(the checkpoint's key for our parameter `key`, its layer or None for a tensor not stacked)."""
    if not key.startswith("decoder.layers."):
        if key not in index:
            raise InputError(f"the checkpoint has no {key}; is it a checkpoint of this architecture?")
        return key, None
    layer, _, name = key[len("decoder.layers."):].partition(".")
    candidates = [theirs for theirs, ours in LAYER_KEYS.items() if ours == name] + [name]
    for candidate in candidates:
        if f"decoder.layers.{candidate}" in index:
            return f"decoder.layers.{candidate}", int(layer)
    raise InputError(f"the checkpoint has no decoder.layers.{candidates[0]} (our {key}); is it a checkpoint of "
                     "this architecture?")


def row_blocks(piece: ShardedTensor, shape: Tuple[int, ...]) -> List[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """Our piece as (data view, offset) blocks of the checkpoint's tensor of `shape`, whose first dimension
    flattens our leading ones (our QKV's [groups, q heads + 2, head dim, hidden] is its [rows, hidden]; our
    SwiGLU fc1's [2, ffn, hidden] its [2 ffn, hidden]): one block, or one per index of the dimensions
    before the first our piece holds part of (a tensor-parallel fc1 piece: its gate rows and its up rows)."""
    ours = tuple(piece.global_shape)
    rest = tuple(shape[1:])
    lead = ours[:len(ours) - len(rest)]
    if ours[len(lead):] != rest or math.prod(lead) != shape[0]:
        raise ValueError(f"tensor {piece.key!r} has shape {tuple(shape)}, this model expects one of "
                         f"{math.prod(lead)} x {ours[len(lead):]} rows; the architecture differs")
    sizes, offsets = piece.data.shape[:len(lead)], piece.global_offset[:len(lead)]
    split = max([k for k in range(len(lead)) if sizes[k] != lead[k]], default=0)
    strides = [math.prod(lead[k + 1:]) for k in range(len(lead))]
    blocks = []
    for index in itertools.product(*(range(size) for size in sizes[:split])):
        start = sum((offsets[k] + index[k]) * strides[k] for k in range(split)) + offsets[split] * strides[split]
        view = piece.data[index] if index else piece.data
        blocks.append((view.reshape(-1, *piece.data.shape[len(lead):]), (start, *piece.global_offset[len(lead):])))
    return blocks


def megatron_lm_pieces(model: torch.nn.Module, index, num_layers: int) -> Dict[str, ShardedTensor]:
    """Our model's checkpoint pieces on this rank, each described as its part of the checkpoint's tensor
    (a layer's piece the slice [layer] of the stacked tensor; row_blocks), so each rank reads only what
    it holds."""
    pieces = {}
    for name, piece in model_sharded_state_dict(model, prefix="").items():
        key, layer = _megatron_key(piece.key, index)
        shape = tuple(index[key].size)
        ours = tuple(piece.global_shape)
        if layer is None and (shape == ours or (piece.padded_rows and shape[1:] == ours[1:])):
            pieces[name] = dataclasses.replace(piece, key=key)  # (the vocabulary's rows both have: serialization)
            continue
        stacked = shape[1:] if layer is not None else shape
        for number, (data, offset) in enumerate(row_blocks(piece, stacked)):
            if layer is not None:
                data, offset = data.unsqueeze(0), (layer, *offset)
            pieces[f"{name}#{number}"] = ShardedTensor(key, data, shape, offset, piece.replica_id, piece.padded_rows)
    return pieces


def _check_all_read(index, pieces: Dict[str, ShardedTensor]) -> None:
    """Collective: every tensor of the checkpoint has a place on some rank (a pipeline stage reads its part)."""
    read = {piece.key for piece in pieces.values()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: List[set] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, read)
        read = set().union(*everyone)
    unread = sorted(key for key in index if key not in read and "_extra_state" not in key)
    if unread:
        raise InputError(f"the checkpoint's {unread[0]} has no place in this model (MoE and other layer specs "
                         "are not read yet); is it a checkpoint of this architecture?")


def load_megatron_lm_model(model: torch.nn.Module, root: str) -> argparse.Namespace:
    """Collective. The weights of the Megatron-LM torch_dist checkpoint under `root` into `model` (this
    rank's parts, whatever layout saved them); returns the run's recorded args."""
    from megatron.core.dist_checkpointing import serialization

    folder = megatron_lm_iteration_dir(root)
    args = read_megatron_lm_args(folder)
    index = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    try:
        pieces = megatron_lm_pieces(model, index, args.num_layers)
        _check_all_read(index, pieces)
        serialization.load(pieces, folder)
    except ValueError as error:  # a tensor missing or of another shape: InputError is one too
        raise InputError(f"--load {root}: {error}") from None
    return args
