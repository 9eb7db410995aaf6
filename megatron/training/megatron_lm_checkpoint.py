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

So far: dense models, one process reading the whole checkpoint (any layout it was saved with: DCP joins
the shards). `tests/assets/megatron/` holds checkpoints megatron-core wrote and the logits it computed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from typing import Dict, List

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.errors import InputError

__all__ = ["megatron_lm_iteration_dir", "read_megatron_lm_args", "megatron_lm_flags", "read_megatron_lm_weights"]

TRACKER = "latest_checkpointed_iteration.txt"
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
WHOLE_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
              "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


def megatron_lm_iteration_dir(root: str) -> str:
    """The iteration folder the tracker names (a `torch_dist` one), or InputError naming what is wrong."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise InputError(f"--load {root}: no {TRACKER}; point it at a Megatron-LM --save directory")
    with open(tracker) as handle:
        text = handle.read().strip()
    folder = os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "")
    try:
        with open(os.path.join(folder, "metadata.json")) as handle:
            backend = json.load(handle).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if backend != "torch_dist":
        raise InputError(f"--load {root}: {folder} is not a torch_dist checkpoint (its metadata.json names "
                         f"{backend!r}); save it with --ckpt-format torch_dist")
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


def megatron_lm_flags(args: argparse.Namespace) -> List[str]:
    """Our flags for the architecture the Megatron-LM run recorded (the same flag names and meanings)."""
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--ffn-hidden-size", str(args.ffn_hidden_size), "--num-attention-heads", str(args.num_attention_heads),
             "--normalization", args.normalization, "--norm-epsilon", str(args.norm_epsilon),
             "--max-position-embeddings", str(args.max_position_embeddings),
             "--position-embedding-type", args.position_embedding_type]
    if getattr(args, "kv_channels", None):
        flags += ["--kv-channels", str(args.kv_channels)]
    if getattr(args, "group_query_attention", False):
        flags += ["--group-query-attention", "--num-query-groups", str(args.num_query_groups)]
    if args.position_embedding_type == "rope":
        flags += ["--rotary-base", str(int(getattr(args, "rotary_base", 10000)))]
    for flag, on in (("--swiglu", args.swiglu), ("--qk-layernorm", getattr(args, "qk_layernorm", False)),
                     ("--disable-bias-linear", not args.add_bias_linear),
                     ("--untie-embeddings-and-output-weights", args.untie_embeddings_and_output_weights)):
        if on:
            flags.append(flag)
    return flags


def read_megatron_lm_weights(folder: str, num_layers: int) -> Dict[str, torch.Tensor]:
    """{our parameter name: whole tensor} of the checkpoint's model (every shard joined)."""
    reader = SafeFileSystemReader(folder)
    index = reader.read_metadata().state_dict_metadata
    wanted = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in index.items()
              if "_extra_state" not in key and hasattr(meta, "size")}
    unknown = [key for key in wanted if key not in WHOLE_KEYS and not key.startswith("decoder.layers.")]
    if unknown:
        raise InputError(f"{folder}: {unknown[0]} is not a tensor of a dense GPT model this reader maps (MoE and "
                         "other layer specs come later)")
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    weights = {key: tensor for key, tensor in wanted.items() if key in WHOLE_KEYS}
    for key, stacked in wanted.items():
        if not key.startswith("decoder.layers."):
            continue
        name = key[len("decoder.layers."):]
        if stacked.shape[0] != num_layers:
            raise InputError(f"{folder}: {key} stacks {stacked.shape[0]} layers, the args say {num_layers}")
        for layer in range(num_layers):
            weights[f"decoder.layers.{layer}.{LAYER_KEYS.get(name, name)}"] = stacked[layer].clone()
    return weights
