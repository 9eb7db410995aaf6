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
reader gives every rank only what it holds, whatever layout saved the checkpoint (expert parallelism
included: the routed experts are [layers, experts, ...] tensors).
The other way (tools/weights_conversion/to_megatron.py): megatron_lm_tensor and megatron_lm_args_for give our
tensors and architecture as megatron-core writes them.
Megatron-LM's legacy `torch` format (per-rank files) joins into the same tensors first (megatron_lm_legacy.py).
`tests/assets/megatron/` holds checkpoints megatron-core wrote and the logits it computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.dist_checkpointing.safe_torch_file import safe_torch_load
from megatron.core.errors import InputError
from megatron.training.megatron_lm_legacy import legacy_global_tensors, legacy_rank_files, read_legacy_args
from megatron.training.checkpoint_files import TRACKER, iteration_dir

__all__ = ["is_megatron_lm_checkpoint", "megatron_lm_iteration_dir", "read_megatron_lm_args",
           "megatron_lm_architecture", "row_blocks", "megatron_lm_pieces", "load_megatron_lm_model",
           "megatron_lm_tensor", "megatron_lm_args_for"]

# megatron-core's stacked decoder keys that differ from ours per layer (a key under our own name, as the local
# modules save their norms, is read as it is: _megatron_key)
LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    # MoE: the routed experts under SequentialMLP's (and the grouped MLPs' checkpoint) name, stacked per expert
    "mlp.experts.experts.linear_fc1.weight": "mlp.experts.linear_fc1.weight",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.linear_fc2.weight",
    "mlp.experts.experts.linear_fc1.bias": "mlp.experts.linear_fc1.bias",
    "mlp.experts.experts.linear_fc2.bias": "mlp.experts.linear_fc2.bias",
}
# Megatron-LM's MoE flags this model reads as they are (the same names and meanings); the gate of shared
# experts has no counterpart here
MOE_FLAGS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
             "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias")


def _tracked(root: str) -> Tuple[Optional[str], Optional[str]]:
    """(the iteration folder the tracker under `root` names, the Megatron-LM format it holds: "torch_dist" (its
    metadata.json names a sharded backend and, unlike ours, no format version) or "torch" (per-rank files)
    or None)."""
    try:
        with open(os.path.join(root, TRACKER)) as handle:
            text = handle.read().strip()
        folder = os.path.join(root, "release") if text == "release" else iteration_dir(root, int(text))
    except (OSError, ValueError):
        return None, None
    if legacy_rank_files(folder):
        return folder, "torch"
    try:
        with open(os.path.join(folder, "metadata.json")) as handle:
            metadata = json.load(handle)
    except (OSError, ValueError):
        return folder, None
    foreign = isinstance(metadata, dict) and "format_version" not in metadata
    return folder, metadata.get("sharded_backend") if foreign else None


def megatron_lm_iteration_dir(root: str) -> str:
    """The iteration folder the tracker names (torch_dist or legacy torch), or InputError naming what is wrong."""
    folder, backend = _tracked(root)
    if folder is None or backend not in ("torch_dist", "torch"):
        raise InputError(f"--load {root}: not a Megatron-LM torch_dist or torch checkpoint (no {TRACKER} naming an "
                         f"iteration with mp_rank_* files or a metadata.json saying torch_dist: {backend!r}); save "
                         "it with --ckpt-format torch_dist")
    return folder


def read_megatron_lm_args(folder: str) -> argparse.Namespace:
    """The `args` Namespace the run recorded: in common.pt (torch_dist) or the first rank's file (legacy);
    weights-only unpickling (safe_torch_load)."""
    if legacy_rank_files(folder):
        return read_legacy_args(folder)
    path = os.path.join(folder, "common.pt")
    common = safe_torch_load(path)
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise InputError(f"{path} holds no args Namespace: not a Megatron-LM checkpoint")
    return args


def is_megatron_lm_checkpoint(root: str) -> bool:
    """Whether the iteration the tracker under `root` names is a Megatron-LM checkpoint (_tracked)."""
    return _tracked(root)[1] is not None


def megatron_lm_architecture(args: argparse.Namespace) -> Dict[str, object]:
    """Our flags' destinations for the architecture the Megatron-LM run recorded (the same flag names
    and meanings; --use-checkpoint-args sets them). What this model cannot compute is one line."""
    if args.position_embedding_type not in ("rope", "learned_absolute"):
        raise InputError(f"the checkpoint's --position-embedding-type {args.position_embedding_type} is not one "
                         "this model has (rope, learned_absolute); it cannot be loaded here")
    for flag in ("squared_relu", "rotary_interleaved"):
        if getattr(args, flag, False):
            raise InputError(f"the checkpoint was trained with --{flag.replace('_', '-')}, which this model does "
                             "not compute; it cannot be loaded here")
    gqa = bool(getattr(args, "group_query_attention", False))
    return _moe_architecture(args) | {
            "num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
            "num_attention_heads": args.num_attention_heads, "group_query_attention": gqa,
            "num_query_groups": args.num_query_groups if gqa else None,
            "kv_channels": getattr(args, "kv_channels", None), "normalization": args.normalization,
            # --norm-epsilon / --apply-layernorm-1p; megatron-core 0.18's flags take TransformerConfig's names
            "norm_epsilon": getattr(args, "norm_epsilon", getattr(args, "layernorm_epsilon", 1e-5)),
            "apply_layernorm_1p": bool(getattr(args, "apply_layernorm_1p", False)
                                       or getattr(args, "layernorm_zero_centered_gamma", False)),
            "swiglu": bool(args.swiglu), "qk_layernorm": bool(getattr(args, "qk_layernorm", False)),
            "disable_bias_linear": not args.add_bias_linear,
            "add_qkv_bias": bool(getattr(args, "add_qkv_bias", False)) and not args.add_bias_linear,
            "untie_embeddings_and_output_weights": bool(args.untie_embeddings_and_output_weights),
            "position_embedding_type": args.position_embedding_type,
            "rotary_base": int(getattr(args, "rotary_base", 10000)),
            "rotary_percent": float(getattr(args, "rotary_percent", 1.0)),
            "use_rope_scaling": bool(getattr(args, "use_rope_scaling", False)),
            "rope_scaling_factor": float(getattr(args, "rope_scaling_factor", 8.0)),
            "max_position_embeddings": args.max_position_embeddings}


def _moe_architecture(args: argparse.Namespace) -> Dict[str, object]:
    """The MoE flags of a run with experts (none for a dense one)."""
    if not getattr(args, "num_experts", None):
        return {}
    if getattr(args, "moe_shared_expert_gate", False):
        raise InputError("the checkpoint's shared experts are gated (--moe-shared-expert-gate), which this model "
                         "does not compute; it cannot be loaded here")
    flags = {flag: getattr(args, flag) for flag in MOE_FLAGS if getattr(args, flag, None) is not None}
    frequency = getattr(args, "moe_layer_freq", 1)  # an int, or Megatron's parsed pattern: a list of 0 / 1
    if isinstance(frequency, (list, tuple)):
        frequency = "[" + ",".join(str(int(flag)) for flag in frequency) + "]"
    return {"num_experts": args.num_experts, "moe_layer_freq": str(frequency), **flags}


def _megatron_key(key: str, index) -> Tuple[str, Optional[int]]:
    """(the checkpoint's key for our parameter `key`, its layer or None for a tensor not stacked)."""
    if not key.startswith("decoder.layers."):
        if key not in index:
            raise InputError(f"the checkpoint has no {key}; is it a checkpoint of this architecture?")
        return key, None
    layer, _, name = key[len("decoder.layers."):].partition(".")
    candidates = [theirs for theirs, ours in LAYER_KEYS.items() if ours == name] + [name]
    for candidate in candidates:
        if f"decoder.layers.{candidate}" in index:  # the layers stacked (one layer spec for all)
            return f"decoder.layers.{candidate}", int(layer)
        if f"decoder.layers.{layer}.{candidate}" in index:  # a spec per layer (dense and MoE ones): each its own
            return f"decoder.layers.{layer}.{candidate}", None
    raise InputError(f"the checkpoint has no decoder.layers.{candidates[0]} (our {key}); is it a checkpoint of "
                     "this architecture?")


def row_blocks(piece: ShardedTensor, shape: Tuple[int, ...]) -> List[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """Our piece as (data view, offset) blocks of the checkpoint's tensor of `shape`, whose first dimension
    flattens our leading ones (our QKV's [groups, q heads + 2, head dim, hidden] is its [rows, hidden]; our
    SwiGLU fc1's [2, ffn, hidden] its [2 ffn, hidden]): one block, or one per index of the dimensions
    before the first our piece holds part of (a tensor-parallel fc1 piece: its gate rows and its up rows).
    A leading dimension both share (the experts: our [experts, 2, ffn, hidden] is its [experts, 2 ffn,
    hidden]) is taken index by index first."""
    ours = tuple(piece.global_shape)
    rest = tuple(shape[1:])
    lead = ours[:len(ours) - len(rest)]
    if ours[len(lead):] != rest or math.prod(lead) != shape[0]:
        if len(ours) > 1 and len(shape) > 1 and ours[0] == shape[0]:
            return _shared_leading_blocks(piece, shape)
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


def _shared_leading_blocks(piece: ShardedTensor, shape: Tuple[int, ...]) -> List[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """row_blocks of each index of the leading dimension our piece and the checkpoint's tensor share."""
    blocks = []
    for index in range(piece.data.shape[0]):
        inner = ShardedTensor(piece.key, piece.data[index], tuple(piece.global_shape[1:]), piece.global_offset[1:])
        for view, offset in row_blocks(inner, shape[1:]):
            blocks.append((view.unsqueeze(0), (piece.global_offset[0] + index, *offset)))
    return blocks


def megatron_lm_pieces(model: torch.nn.Module, index, num_layers: int) -> Dict[str, ShardedTensor]:
    """Our model's checkpoint pieces on this rank, each described as its part of the checkpoint's tensor
    (a layer's piece the slice [layer] of the stacked tensor; row_blocks), so each rank reads only what
    it holds."""
    pieces = {}
    for whole_name, whole in model_sharded_state_dict(model, prefix="").items():
        for name, piece in _singleton_parts(whole_name, whole, index):
            key, layer = (piece.key, None) if piece.key in index else _megatron_key(piece.key, index)
            shape = tuple(index[key].size)
            ours = tuple(piece.global_shape)
            if layer is None and (shape == ours or (piece.padded_rows and shape[1:] == ours[1:])):
                pieces[name] = dataclasses.replace(piece, key=key)  # (the vocabulary's rows both have: serialization)
                continue
            stacked = shape[1:] if layer is not None else shape
            for number, (data, offset) in enumerate(row_blocks(piece, stacked)):
                if layer is not None:
                    data, offset = data.unsqueeze(0), (layer, *offset)
                pieces[f"{name}#{number}"] = ShardedTensor(key, data, shape, offset, piece.replica_id,
                                                           piece.padded_rows)
    return pieces


def _singleton_parts(name: str, piece: ShardedTensor, index) -> List[Tuple[str, ShardedTensor]]:
    """[(name, piece)], or under megatron-core's singleton_local_shards layout the piece's parts with their own
    keys: each routed expert (`mlp.experts.experts.<e>.…`) and a gated fc1's gate and up rows (`weight_w`,
    `weight_v`)."""
    prefix, found, rest = piece.key.partition(".mlp.experts.")
    if found and any(f"{prefix}.mlp.experts.experts.0.{rest}{half}" in index for half in ("", "_w")):
        parts = []
        for local in range(piece.data.shape[0]):
            expert = piece.global_offset[0] + local
            part = ShardedTensor(f"{prefix}.mlp.experts.experts.{expert}.{rest}", piece.data[local],
                                 tuple(piece.global_shape[1:]), tuple(piece.global_offset[1:]), piece.replica_id)
            parts += _singleton_parts(f"{name}#expert{expert}", part, index)
        return parts
    if piece.key.endswith("linear_fc1.weight") and f"{piece.key}_w" in index and piece.global_shape[0] == 2:
        return [(f"{name}#{'wv'[piece.global_offset[0] + local]}",
                 ShardedTensor(f"{piece.key}_{'wv'[piece.global_offset[0] + local]}", piece.data[local],
                               tuple(piece.global_shape[1:]), tuple(piece.global_offset[1:]), piece.replica_id))
                for local in range(piece.data.shape[0])]
    return [(name, piece)]


# Our layer tensors -> the keys megatron-core writes for them (Transformer Engine's fused-norm names,
# which its local spec's sharded state dict uses too)
EXPORT_LAYER_KEYS = {ours: theirs for theirs, ours in LAYER_KEYS.items()}
# Our activation and gating -> Megatron-LM's flag for it (None: its default GeLU)
EXPORT_ACTIVATIONS = {("silu", True): "swiglu", ("gelu", False): None}


def megatron_lm_tensor(name: str, tensor: torch.Tensor) -> Tuple[str, Optional[int], torch.Tensor]:
    """(the key megatron-core stores our tensor `name` under, its layer or None, the tensor in its layout:
    our leading dimensions flattened into rows, as row_blocks reads them back; the experts' dimension kept)."""
    layer = None
    if name.startswith("decoder.layers."):
        number, _, rest = name[len("decoder.layers."):].partition(".")
        name, layer = "decoder.layers." + EXPORT_LAYER_KEYS.get(rest, rest), int(number)
    lead = tensor.shape[:1] if ".experts.experts." in name else ()  # [experts, ...]
    if name.endswith("weight") and tensor.dim() > 2 + len(lead):
        tensor = tensor.reshape(*lead, -1, tensor.shape[-1])
    elif not name.endswith("weight") and tensor.dim() > 1 + len(lead):
        tensor = tensor.reshape(*lead, -1)
    return name, layer, tensor


def _moe_args(moe: dict) -> Dict[str, object]:
    """Megatron-LM's MoE flags for our MoEConfig (a checkpoint's `transformer_config.moe`; {} dense)."""
    if not moe:
        return {"num_experts": None}
    names = {"moe_ffn_hidden_size": "ffn_hidden_size", "moe_router_topk": "router_topk",
             "moe_router_pre_softmax": "router_pre_softmax", "moe_router_score_function": "router_score_function",
             "moe_router_topk_scaling_factor": "router_topk_scaling_factor",
             "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
             "moe_router_enable_expert_bias": "router_enable_expert_bias"}
    flags = moe.get("layer_flags") or [1]
    return {"num_experts": moe["num_experts"], "moe_layer_freq": 1 if all(flags) else list(flags),
            "moe_grouped_gemm": False, **{flag: moe.get(field) for flag, field in names.items()}}


def megatron_lm_args_for(config: dict, iteration: int, seq_length: Optional[int]) -> argparse.Namespace:
    """The args Namespace a Megatron-LM run of our architecture (a checkpoint's `transformer_config`) records
    in common.pt: what its --use-checkpoint-args and megatron_lm_architecture read. One layout (TP = PP = 1)."""
    activation = (config["activation"], config["gated_linear_unit"])
    moe = config.get("moe") or {}
    refusals = {f"a {moe.get('router_type')} router": moe.get("router_type", "token_choice") != "token_choice",
                f"the activation {activation}": activation not in EXPORT_ACTIVATIONS,
                "--qk-layernorm-scope all": config.get("qk_layernorm_scope", "head") != "head",
                f"RoPE scaling {config.get('rope_scaling_type')}": config.get("rope_scaling_type") not in
                (None, "none", "llama3")}
    for what, refused in refusals.items():
        if refused:
            raise InputError(f"the checkpoint has {what}, which this export does not write in Megatron-LM's format")
    heads, groups = config["num_attention_heads"], config.get("num_query_groups") or config["num_attention_heads"]
    return argparse.Namespace(**_moe_args(moe),
        num_layers=config["num_layers"], hidden_size=config["hidden_size"], ffn_hidden_size=config["ffn_hidden_size"],
        num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=config.get("kv_channels") or config["hidden_size"] // heads,
        normalization=config["normalization"], norm_epsilon=config["layernorm_epsilon"],
        layernorm_epsilon=config["layernorm_epsilon"],  # (the name newer Megatron-LM records as well)
        apply_layernorm_1p=bool(config.get("layernorm_zero_centered_gamma")),
        layernorm_zero_centered_gamma=bool(config.get("layernorm_zero_centered_gamma")),
        swiglu=EXPORT_ACTIVATIONS[activation] == "swiglu", squared_relu=False,
        qk_layernorm=bool(config["qk_layernorm"]), add_bias_linear=bool(config["add_bias_linear"]),
        add_qkv_bias=bool(config["add_bias_linear"] or config.get("add_qkv_bias")),
        untie_embeddings_and_output_weights=not config["share_embeddings_and_output_weights"],
        position_embedding_type=config.get("position_embedding_type", "rope"),
        use_rotary_position_embeddings=config.get("position_embedding_type", "rope") == "rope",
        add_position_embedding=config.get("position_embedding_type") == "learned_absolute",
        rotary_base=config["rotary_base"], rotary_percent=config.get("rotary_percent", 1.0), rotary_interleaved=False,
        use_rope_scaling=config.get("rope_scaling_type") == "llama3",
        rope_scaling_factor=config.get("rope_scaling_factor", 8.0),
        max_position_embeddings=config["max_position_embeddings"], seq_length=seq_length,
        padded_vocab_size=config["vocab_size"], vocab_size=config.get("unpadded_vocab_size") or config["vocab_size"],
        make_vocab_size_divisible_by=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        transformer_impl="local", ckpt_format="torch_dist", iteration=iteration,
        hidden_dropout=config.get("hidden_dropout", 0.0), attention_dropout=config.get("attention_dropout", 0.0),
        apply_query_key_layer_scaling=False, bf16=False, fp16=False, params_dtype=torch.float32)


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


@torch.no_grad()
def _copy_pieces(pieces: Dict[str, ShardedTensor], tensors: Dict[str, torch.Tensor]) -> None:
    """Each piece's box of the whole tensor under its key, into the piece (our parameters' views); rows past
    the stored ones (a vocabulary padded further, an appended mask row) keep their initialisation."""
    for piece in pieces.values():
        whole = tensors[piece.key]
        stops = [min(start + size, extent) for start, size, extent in
                 zip(piece.global_offset, piece.data.shape, whole.shape)]
        if any(stop <= start for start, stop in zip(piece.global_offset, stops)):
            continue
        piece.data[tuple(slice(0, stop - start) for start, stop in zip(piece.global_offset, stops))].copy_(
            whole[tuple(slice(start, stop) for start, stop in zip(piece.global_offset, stops))])


def load_megatron_lm_model(model: torch.nn.Module, root: str) -> argparse.Namespace:
    """Collective. The weights of the Megatron-LM checkpoint under `root` (torch_dist or legacy torch) into
    `model` (this rank's parts, whatever layout saved them); returns the run's recorded args."""
    from megatron.core.dist_checkpointing import serialization

    folder = megatron_lm_iteration_dir(root)
    args = read_megatron_lm_args(folder)
    try:
        if legacy_rank_files(folder):
            tensors = legacy_global_tensors(folder, args)
            index = {key: argparse.Namespace(size=tensor.shape) for key, tensor in tensors.items()}
            pieces = megatron_lm_pieces(model, index, args.num_layers)
            _check_all_read(index, pieces)
            _copy_pieces(pieces, tensors)
            return args
        index = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
        pieces = megatron_lm_pieces(model, index, args.num_layers)
        _check_all_read(index, pieces)
        serialization.load(pieces, folder)
    except ValueError as error:  # a tensor missing or of another shape: InputError is one too
        raise InputError(f"--load {root}: {error}") from None
    return args
