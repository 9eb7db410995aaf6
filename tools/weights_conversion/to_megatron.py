"""Write a MegaDLMs checkpoint as a Megatron-LM `torch_dist` checkpoint (GPT models, dense or with MoE layers).

    python tools/weights_conversion/to_megatron.py --load CKPT_DIR [--iteration N] --save MEGATRON_DIR

MEGATRON_DIR then holds what megatron-core's `dist_checkpointing.save` writes for a GPT model of its
local layer spec saved by one process: `latest_checkpointed_iteration.txt`, `iter_NNNNNNN/` with
`metadata.json` (`"sharded_backend": "torch_dist"`), DCP's `.metadata` and one shard file, and
`common.pt` (the run's `args` Namespace, `checkpoint_version` 3.0, `iteration`). The keys, the layers
stacked along a leading dimension and the QKV and fc1 row orders are megatron-core's (the ones
`--load MEGATRON_DIR --finetune --use-checkpoint-args` reads back here, megatron_lm_checkpoint.py); the
`_extra_state` entries megatron-core's linear layers expect are written as its local spec writes them;
routed experts as its SequentialMLP saves them (`mlp.experts.experts.*`, [layers, experts, ...]), shared
experts as `mlp.shared_experts.*`. MoE layers among dense ones are written as megatron-core writes layers
that differ: each under its own keys (`decoder.layers.<i>.…`, not stacked; `--moe-layer-freq` as its list).
Megatron-LM continues from it with `pretrain_gpt.py --load MEGATRON_DIR --finetune --use-checkpoint-args`
(its own layout flags; megatron-core reshards on load). The weights keep the dtype they were saved in; a
DLM checkpoint's mask token is a vocabulary row like any other, and its running mode and mask id ride in
`args` as `model_running_mode` and `mask_token` (fields Megatron-LM's GPT ignores).

MEGATRON_DIR must not exist or be empty (nothing is overwritten); the checkpoint is built in a sibling
`MEGATRON_DIR.tmp-<pid>/` and renamed into place whole, so a failure leaves no partial checkpoint.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.core.errors import InputError  # noqa: E402
from megatron.training.checkpoint_files import (TRACKER, check_shard_files, configs_from_metadata,  # noqa: E402
                                                read_metadata, resolve_checkpoint)
from megatron.training.megatron_lm_checkpoint import megatron_lm_args_for, megatron_lm_tensor  # noqa: E402
from tools.weights_conversion import checkpoint_io, mapping  # noqa: E402

# What megatron-core writes beside the shards (dist_checkpointing's metadata.json)
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
# The linear layers whose `_extra_state` megatron-core's local spec saves (None, as a one-element list): per
# layer, and per layer and expert for the routed experts (SequentialMLP's)
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
SHARED_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="MegaDLMs checkpoint folder (the one --save wrote).")
    parser.add_argument("--iteration", type=int, help="Iteration to convert (default: the latest).")
    parser.add_argument("--save", required=True, help="New folder for the Megatron-LM checkpoint.")
    return parser.parse_args(argv)


class _RawBytesPlanner(DefaultSavePlanner):
    """Writes BytesIO values as they are (megatron-core's planner does: its objects are serialized already)."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def _serialized(value) -> io.BytesIO:
    """A sharded object's bytes as megatron-core stores them: torch.save of the list of its data."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    buffer.seek(0)
    return buffer


def megatron_state(iter_dir: str, config) -> Dict[str, object]:
    """{megatron-core key: stacked tensor or serialized object} of our checkpoint's weights."""
    shapes = checkpoint_io.stored_shapes(iter_dir)
    state: Dict[str, object] = {}
    for name, tensor in checkpoint_io.read_tensors(iter_dir, mapping.global_names(config), shapes).items():
        key, _, tensor = megatron_lm_tensor(name, tensor)
        state[key] = tensor
    layers: Dict[str, List[torch.Tensor]] = {}
    own_keys = per_layer_keys(config)
    for index in range(config.num_layers):
        prefix = f"decoder.layers.{index}."
        names = [prefix + name for name in mapping.layer_names(config, index)]
        for name, tensor in checkpoint_io.read_tensors(iter_dir, names, shapes).items():
            key, _, tensor = megatron_lm_tensor(name, tensor)
            if own_keys:
                state[prefix + key[len("decoder.layers."):]] = tensor
            else:
                layers.setdefault(key, []).append(tensor)
        state.update(_extra_states(config, index, own_keys))
    state.update({key: torch.stack(tensors) for key, tensors in layers.items()})
    return state


def per_layer_keys(config) -> bool:
    """Whether megatron-core keys each layer's tensors apart (`decoder.layers.<i>.…`) instead of stacking them:
    when its layers differ (MoE layers among dense ones: a spec per layer, non-homogeneous)."""
    return config.moe is not None and 0 in (config.moe.layer_flags or [1])


def _extra_states(config, index: int, own_keys: bool) -> Dict[str, io.BytesIO]:
    """Layer `index`'s `_extra_state` objects under megatron-core's keys, `/shard_<offset>_<global shape>`: the
    layer's place among the stacked layers (alone under its own keys: 0 of 1), then the expert's among the
    routed experts."""
    moe = config.moe is not None and config.moe.is_moe_layer(index)
    linears = LINEARS
    if moe:
        linears = LINEARS[:2] + (SHARED_LINEARS if config.moe.shared_expert_intermediate_size else ())
    layer_at, layer_of = ([], []) if own_keys else ([index], [config.num_layers])
    entries = [(linear, layer_at, layer_of) for linear in linears]
    if moe:
        experts = config.moe.num_experts
        entries += [(linear, layer_at + [expert], layer_of + [experts]) for linear in EXPERT_LINEARS
                    for expert in range(experts)]
    base = f"decoder.layers.{index}." if own_keys else "decoder.layers."
    return {f"{base}{linear}._extra_state/shard_{_dotted(at or [0])}_{_dotted(of or [1])}": _serialized(None)
            for linear, at, of in entries}


def _dotted(values: List[int]) -> str:
    return ".".join(str(value) for value in values)


def check_save(save: str) -> None:
    if os.path.isfile(save) or (os.path.isdir(save) and os.listdir(save)):
        raise InputError(f"--save {save} exists and is not empty; choose a new folder (nothing is overwritten)")


def write(state: Dict[str, object], common: dict, iteration: int, folder: str) -> None:
    """The Megatron-LM folder: tracker, iter_NNNNNNN/ with the DCP files, common.pt and metadata.json."""
    iter_dir = os.path.join(folder, f"iter_{iteration:07d}")
    os.makedirs(iter_dir)
    with warnings.catch_warnings():  # DCP notes that it runs without a process group: intended
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(iter_dir), planner=_RawBytesPlanner())
    torch.save(common, os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as handle:
        json.dump(BACKEND, handle)
    with open(os.path.join(folder, TRACKER), "w") as handle:
        handle.write(str(iteration))


def convert(args: argparse.Namespace) -> dict:
    """Check every input, build the checkpoint beside --save, then rename it into place."""
    iter_dir, iteration = resolve_checkpoint(args.load, args.iteration)
    metadata = read_metadata(iter_dir)
    check_shard_files(iter_dir)
    config, dlm = configs_from_metadata(metadata)
    megatron_args = megatron_lm_args_for(metadata["transformer_config"], iteration, metadata.get("seq_length"))
    megatron_args.model_running_mode, megatron_args.mask_token = dlm.model_running_mode, dlm.mask_token_id
    check_save(args.save)
    state = megatron_state(iter_dir, config)
    staging = f"{os.path.abspath(args.save)}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(state, {"args": megatron_args, "checkpoint_version": 3.0, "iteration": iteration}, iteration, staging)
        if os.path.isdir(args.save):
            os.rmdir(args.save)  # empty (check_save)
        os.rename(staging, args.save)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"iteration": iteration, "tensors": sum(isinstance(v, torch.Tensor) for v in state.values()),
            "mode": dlm.model_running_mode, "flags": flags_to_pass(megatron_args)}


def flags_to_pass(megatron_args: argparse.Namespace) -> List[str]:
    """The architecture flags Megatron-LM's --use-checkpoint-args does not restore (its load_args_from_checkpoint
    list) where this model differs from Megatron-LM's defaults: its user passes them with --load."""
    flags = ["--qk-layernorm"] if megatron_args.qk_layernorm else []
    if megatron_args.apply_layernorm_1p:  # restored under this name, read under layernorm_zero_centered_gamma
        flags.append("--apply-layernorm-1p")
    if megatron_args.norm_epsilon != 1e-5:
        flags += ["--norm-epsilon", f"{megatron_args.norm_epsilon:g}"]
    if megatron_args.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{megatron_args.rope_scaling_factor:g}"]
    return flags


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        summary = convert(args)
    except (ValueError, OSError) as error:  # InputError and CheckpointError are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"> wrote a Megatron-LM torch_dist checkpoint of iteration {summary['iteration']} "
          f"({summary['tensors']} tensors, running mode {summary['mode']}) to {args.save}")
    if summary["flags"]:
        print(f"note: Megatron-LM's --use-checkpoint-args does not restore {' '.join(summary['flags'])}: pass them "
              "to its pretrain_gpt.py with --load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
