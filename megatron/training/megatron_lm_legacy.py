"""Read Megatron-LM's legacy `torch` checkpoint format (`--ckpt-format torch`) of megatron-core's GPT model.

The iteration folder holds one `mp_rank_TT/model_optim_rng.pt` per tensor-parallel rank (`mp_rank_TT_PPP/`
with pipeline parallelism), each a torch.save of the run's `args`, `checkpoint_version`, `iteration`, the
rank's `model` state dict (megatron-core's module names, layers numbered within the pipeline stage) and its
optimizer and RNG states. Read with safe_torch_load (weights-only, memory-mapped): no code from the files runs.

`legacy_global_tensors` joins the ranks' pieces into the tensors megatron-core's `torch_dist` format stores
under the same keys (layers stacked in order, tensor-parallel pieces concatenated along the dimension the
layer splits: column-parallel rows, row-parallel columns, SwiGLU's fc1 as all gates then all ups), so the
torch_dist reader places them in our model under any layout. Each rank joins the whole model in host memory
(the files are memory-mapped, the joined tensors are copies): a model's size per rank, once at start; for a
model too large for that, Megatron-LM's own converter to torch_dist first (which loads here piece by piece).
Megatron-LM's older `language_model.*` GPT (before megatron-core), uneven pipeline stages and MoE models
(their experts saved per expert-parallel rank) are refused in one line.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Tuple

import torch

from megatron.core.dist_checkpointing.safe_torch_file import safe_torch_load
from megatron.core.errors import InputError

__all__ = ["legacy_rank_files", "read_legacy_args", "legacy_global_tensors"]

RANK_FOLDER = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
RANK_FILE = "model_optim_rng.pt"
# megatron-core's tensor-parallel layers: the dimension a rank's piece splits (others are replicated)
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def legacy_rank_files(folder: str) -> Dict[Tuple[int, int], str]:
    """{(tensor-parallel rank, pipeline stage): its model_optim_rng.pt} in an iteration folder."""
    found = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = RANK_FOLDER.match(name)
        path = os.path.join(folder, name, RANK_FILE)
        if match and os.path.isfile(path):
            found[(int(match[1]), int(match[2] or 0))] = path
    return found


def read_legacy_args(folder: str) -> argparse.Namespace:
    """The `args` the first rank's file recorded."""
    path = legacy_rank_files(folder)[(0, 0)]
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


def _layout(folder: str, files: Dict[Tuple[int, int], str], args: argparse.Namespace) -> Tuple[int, int]:
    """(tensor-parallel size, pipeline stages) of the files, every rank's present, stages even."""
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise InputError(f"{folder} has no {RANK_FILE} of tensor-parallel rank {missing[0][0]}, pipeline stage "
                         f"{missing[0][1]}: copy the whole checkpoint")
    if getattr(args, "num_experts", None):
        raise InputError(f"{folder}: a mixture-of-experts checkpoint in the legacy torch format is not read yet (its "
                         "experts per expert-parallel rank); save it with --ckpt-format torch_dist, which loads")
    uneven = [flag for flag in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
              if getattr(args, flag, None) is not None]
    if uneven or args.num_layers % pp:
        raise InputError(f"{folder}: pipeline stages of uneven depth ({uneven or args.num_layers}) are not read yet; "
                         "save it with even stages or in the torch_dist format")
    return tp, pp


def legacy_global_tensors(folder: str, args: argparse.Namespace) -> Dict[str, torch.Tensor]:
    """{torch_dist key: whole tensor} of the legacy checkpoint in `folder` (layers stacked)."""
    files = legacy_rank_files(folder)
    tp, pp = _layout(folder, files, args)
    tied = not args.untie_embeddings_and_output_weights
    tensors: Dict[str, torch.Tensor] = {}
    layers: Dict[str, Dict[int, torch.Tensor]] = {}
    for stage in range(pp):
        states = [safe_torch_load(files[(rank, stage)])["model"] for rank in range(tp)]
        for name, value in states[0].items():
            if name.startswith("language_model."):
                raise InputError(f"{files[(0, stage)]} holds Megatron-LM's older GPT model ({name}); convert it to "
                                 "megatron-core's with Megatron-LM's tools/checkpoint first")
            if not isinstance(value, torch.Tensor) or (tied and name.startswith("output_layer.")):
                continue  # `_extra_state` entries; the last stage's copy of tied embeddings
            joined = _join(name, [state[name] for state in states], bool(args.swiglu))
            if name.startswith("decoder.layers."):
                number, _, rest = name[len("decoder.layers."):].partition(".")
                layers.setdefault(rest, {})[stage * (args.num_layers // pp) + int(number)] = joined
            else:
                tensors.setdefault(name, joined)
    for rest, by_layer in layers.items():
        if sorted(by_layer) != list(range(args.num_layers)):
            raise InputError(f"{folder}: decoder.layers.*.{rest} is missing for some of the {args.num_layers} layers")
        tensors[f"decoder.layers.{rest}"] = torch.stack([by_layer[index] for index in range(args.num_layers)])
    return tensors
