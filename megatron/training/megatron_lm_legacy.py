"""Read Megatron-LM's legacy `torch` checkpoint format (`--ckpt-format torch`) of megatron-core's GPT model.

The iteration folder holds one `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per model-parallel rank (PPP with
pipeline parallelism, EEE with expert parallelism: which one a single suffix is, the recorded args say), each
a torch.save of the run's `args`, `checkpoint_version`, `iteration`, the rank's `model` state dict
(megatron-core's module names, layers numbered within the pipeline stage, an expert-parallel rank's routed
experts `mlp.experts.local_experts.<j>` numbered within the rank) and its optimizer and RNG states. Read with
safe_torch_load (weights-only, memory-mapped): no code from the files runs.

`legacy_global_tensors` joins the ranks' pieces into the tensors megatron-core's `torch_dist` format stores
with each layer under its own keys (`decoder.layers.<i>.…`, its non_homogeneous_layers layout, and each routed
expert under `mlp.experts.experts.<e>.…`, its singleton_local_shards one), the tensor-parallel pieces
concatenated along the dimension the layer splits (column-parallel rows, row-parallel columns, SwiGLU's fc1
as all gates then all ups), so the torch_dist reader places them in our model under any layout. Each rank
joins the whole model in host memory (the files are memory-mapped, the joined tensors are copies): a model's
size per rank, once at start; for a model too large for that, Megatron-LM's own converter to torch_dist first
(which loads here piece by piece). Megatron-LM's older GPT model (megatron/legacy/model, before megatron-core:
nested `language_model.{embedding,encoder,output_layer}` state dicts, checkpoint_version 2 or later) is read under
megatron-core's names (its QKV rows grouped per query group and SwiGLU's [gate; up] as megatron-core's). Uneven
pipeline stages are refused in one line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.safe_torch_file import safe_torch_load
from megatron.core.errors import InputError

__all__ = ["legacy_rank_files", "read_legacy_args", "legacy_global_tensors"]

RANK_FOLDER = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})$")
RANK_FILE = "model_optim_rng.pt"
# megatron-core's tensor-parallel layers: the dimension a rank's piece splits (others are replicated)
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
# Megatron-LM's older GPT (megatron/legacy/model, before megatron-core): its modules -> megatron-core's, the
# prefixes first, then the layer parts (older releases: `transformer`, `attention`, `*_layernorm`)
PRE_MCORE_NAMES = (("language_model.embedding.", "embedding."), ("language_model.encoder.", "decoder."),
                   ("language_model.transformer.", "decoder."), ("language_model.output_layer.", "output_layer."))
PRE_MCORE_LAYER_NAMES = ((".attention.", ".self_attention."), (".query_key_value.", ".linear_qkv."),
                         ("self_attention.dense.", "self_attention.linear_proj."),
                         (".input_norm.", ".input_layernorm."),
                         (".post_attention_norm.", ".pre_mlp_layernorm."),
                         (".post_attention_layernorm.", ".pre_mlp_layernorm."),
                         ("mlp.dense_h_to_4h.", "mlp.linear_fc1."), ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
                         ("decoder.final_norm.", "decoder.final_layernorm."))
LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def legacy_rank_files(folder: str) -> Dict[Tuple[int, ...], str]:
    """{(tensor-parallel rank, then the folder name's other numbers): its model_optim_rng.pt} in an iteration
    folder (`_rank_layout` says which number is the pipeline stage and which the expert-parallel rank)."""
    found = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = RANK_FOLDER.match(name)
        path = os.path.join(folder, name, RANK_FILE)
        if match and os.path.isfile(path):
            found[(int(match[1]), *(int(part) for part in match[2].split("_")[1:]))] = path
    return found


def read_legacy_args(folder: str) -> argparse.Namespace:
    """The `args` the first rank's file recorded."""
    files = legacy_rank_files(folder)
    path = files[min(files)]
    args = safe_torch_load(path).get("args")
    if not isinstance(args, argparse.Namespace):
        raise InputError(f"{path} holds no args Namespace: not a Megatron-LM checkpoint")
    return args


def _join(name: str, pieces: List[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One tensor from the tensor-parallel ranks' pieces of it."""
    if name.endswith(ROW_PARALLEL):
        return torch.cat(pieces, dim=1)
    if not name.endswith(COLUMN_PARALLEL):
        return pieces[0]
    if swiglu and "linear_fc1" in name:  # each rank's [gate; up]: all gates, then all ups
        halves = [piece.chunk(2, dim=0) for piece in pieces]
        return torch.cat([half[0] for half in halves] + [half[1] for half in halves], dim=0)
    return torch.cat(pieces, dim=0)


def _rank_layout(folder: str, files: Dict[Tuple[int, ...], str],
                 args: argparse.Namespace) -> Dict[Tuple[int, int, int], str]:
    """{(tensor-parallel rank, pipeline stage, expert-parallel rank): file}, every rank's present, stages even."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    ranks = {}
    for numbers, path in files.items():
        rest = list(numbers[1:])
        stage = rest.pop(0) if pp > 1 and rest else 0
        expert = rest.pop(0) if ep > 1 and rest else 0
        ranks[(numbers[0], stage, expert)] = path
    missing = [key for key in itertools.product(range(tp), range(pp), range(ep)) if key not in ranks]
    if missing:
        raise InputError(f"{folder} has no {RANK_FILE} of tensor-parallel rank {missing[0][0]}, pipeline stage "
                         f"{missing[0][1]}, expert-parallel rank {missing[0][2]}: copy the whole checkpoint")
    uneven = [flag for flag in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
              if getattr(args, flag, None) is not None]
    if uneven or args.num_layers % pp:
        raise InputError(f"{folder}: pipeline stages of uneven depth ({uneven or args.num_layers}) are not read yet; "
                         "save it with even stages or in the torch_dist format")
    return ranks


def _global_name(name: str, stage: int, expert_rank: int, args: argparse.Namespace) -> str:
    """A rank's state-dict name as megatron-core's per-layer torch_dist key: the layer numbered in the whole
    model, a routed expert in all experts."""
    if not name.startswith("decoder.layers."):
        return name
    number, _, rest = name[len("decoder.layers."):].partition(".")
    expert = LOCAL_EXPERT.match(rest)
    if expert:
        local_experts = args.num_experts // (getattr(args, "expert_model_parallel_size", 1) or 1)
        rest = f"mlp.experts.experts.{expert_rank * local_experts + int(expert[1])}.{expert[2]}"
    return f"decoder.layers.{stage * (args.num_layers // args.pipeline_model_parallel_size) + int(number)}.{rest}"


def _flat(state: dict, prefix: str = "") -> Dict[str, object]:
    """A state dict with nested dicts (the pre-megatron-core model's) as one level of dotted names."""
    flat: Dict[str, object] = {}
    for name, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _model_state(path: str) -> Dict[str, object]:
    """A rank's model state under megatron-core's names (the pre-megatron-core GPT's renamed)."""
    checkpoint = safe_torch_load(path)
    state = _flat(checkpoint["model"])
    if not any(name.startswith("language_model.") for name in state):
        return state
    if checkpoint.get("checkpoint_version", 0) < 2:
        raise InputError(f"{path} is a checkpoint_version {checkpoint.get('checkpoint_version', 0)} GPT (its QKV rows "
                         "in an older order); save it again with a newer Megatron-LM first")
    renamed = {}
    for name, value in state.items():
        if name.startswith("word_embeddings_for_head."):
            continue  # the last stage's copy of tied embeddings (the first stage's is read)
        ours = pre_mcore_name(name)
        if ours is None and isinstance(value, torch.Tensor):
            raise InputError(f"{path}: {name} of Megatron-LM's older GPT model has no megatron-core counterpart here "
                             "(an encoder-decoder or MoE model?); it cannot be loaded")
        if ours is not None:
            renamed[ours] = value
    return renamed


def pre_mcore_name(name: str) -> Optional[str]:
    """megatron-core's name of a tensor of Megatron-LM's older `language_model.*` GPT (None: it has none)."""
    for old, new in PRE_MCORE_NAMES:
        if name.startswith(old):
            name = new + name[len(old):]
    if not name.startswith(("embedding.", "decoder.", "output_layer.")):
        return None
    for old, new in PRE_MCORE_LAYER_NAMES:
        name = name.replace(old, new)
    return name


def legacy_global_tensors(folder: str, args: argparse.Namespace) -> Dict[str, torch.Tensor]:
    """{torch_dist key (each layer and routed expert its own): whole tensor} of the legacy checkpoint in
    `folder` (megatron-core's GPT, or the older `language_model.*` one under megatron-core's names)."""
    ranks = _rank_layout(folder, legacy_rank_files(folder), args)
    tp = args.tensor_model_parallel_size
    tied = not args.untie_embeddings_and_output_weights
    tensors: Dict[str, torch.Tensor] = {}
    for _, stage, expert_rank in sorted(key for key in ranks if key[0] == 0):
        states = [_model_state(ranks[(rank, stage, expert_rank)]) for rank in range(tp)]
        for name, value in states[0].items():
            if not isinstance(value, torch.Tensor) or (tied and name.startswith("output_layer.")):
                continue  # `_extra_state` entries; the last stage's copy of tied embeddings
            key = _global_name(name, stage, expert_rank, args)
            if key not in tensors:  # the expert-parallel ranks' copies of the other tensors are the same
                tensors[key] = _join(name, [state[name] for state in states], bool(args.swiglu))
    return tensors
