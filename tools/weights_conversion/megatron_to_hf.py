"""Convert a MegaDLMs training checkpoint (any tensor/data-parallel layout) to a Hugging Face folder.

    python tools/weights_conversion/megatron_to_hf.py --load CKPT_DIR [--iteration N] --save HF_DIR \
        [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer-model spm.model] [--hf-architecture auto]

Writes safetensors shards (+ index when sharded), config.json with every architecture field from the
checkpoint's metadata, generation_config.json and the training tokenizer (tokenizer.json,
tokenizer_config.json, and the original files). Autoregressive (`vanilla`) checkpoints of the Llama,
Qwen2 or Qwen3 architecture become native LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
folders, mixture-of-experts ones Qwen3MoeForCausalLM / OlmoeForCausalLM (experts written per
expert, `mlp.experts.{j}.*`, as save_pretrained does); everything else (every difflm-* mode,
shared experts, expert biases, other routers) gets the remote-code DLMForCausalLM
(configuration_dlm.py, modeling_dlm.py, and generation.py, generation_options.py, kv_cache.py, cuda_graphs.py,
likelihood.py, rope_scaling.py), loaded with `AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)`.

Safety of an existing HF_DIR: the export is built whole in a sibling `HF_DIR.tmp-<pid>/` and only
then replaces HF_DIR in one atomic exchange of the two directories (Linux renameat2
RENAME_EXCHANGE), after which the old folder is deleted. So a failure leaves HF_DIR byte for byte
as it was (the temporary folder is removed), and a crash or kill at any moment leaves HF_DIR
holding either the old complete export or the new one. Where the file system cannot exchange,
two renames are used: a crash between them leaves no HF_DIR, the old export complete in
`HF_DIR.old-<pid>/` and the new one in `HF_DIR.tmp-<pid>/` (rename either to HF_DIR); a kill while
writing leaves an unfinished `HF_DIR.tmp-<pid>/`, safe to delete. Files of
HF_DIR that no export writes (a README you added) are copied into the new folder; stale files of
the old export (shards, remote code) are not. An existing HF_DIR must be empty or an earlier
export (config.json, no subfolders): the export replaces the whole folder.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
from typing import List, Optional

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.errors import InputError  # noqa: E402
from megatron.training.checkpoint_files import (check_shard_files, configs_from_metadata, read_metadata,  # noqa: E402
                                                resolve_checkpoint)
from megatron.training.tokenizer.identity import rebuild_training_tokenizer  # noqa: E402
from tools.weights_conversion import checkpoint_io, hf_config, mapping  # noqa: E402
from tools.weights_conversion.safetensors_io import INDEX_FILE, ShardedWriter, parse_size  # noqa: E402
from tools.weights_conversion.tokenizer_export import TokenizerExportError, export_tokenizer  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_dlm")
INFERENCE = os.path.join(REPO_ROOT, "megatron", "core", "inference")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
REMOTE_CODE = ("configuration_dlm.py", "modeling_dlm.py", "generation.py", "generation_options.py", "kv_cache.py",
               "cuda_graphs.py", "likelihood.py", "rope_scaling.py")
# Torch-only library files the remote code imports, by where they live (the rest: hf_dlm/ or inference/).
LIBRARY_CODE = {"rope_scaling.py": os.path.join(REPO_ROOT, "megatron", "core", "transformer")}
# Every name an export may write: these are replaced, never carried over from an earlier export.
EXPORT_FILES = {"config.json", "generation_config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", *REMOTE_CODE}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory written by --save (or an iter_ folder).")
    parser.add_argument("--iteration", type=int, help="Iteration to convert (default: the latest).")
    parser.add_argument("--save", required=True, help="Output Hugging Face folder.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="Weight dtype (default: bfloat16 if the run "
                        "trained with --bf16, float16 with --fp16, else float32).")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard (e.g. 5GB, 500MB).")
    parser.add_argument("--hf-architecture", default="auto", choices=hf_config.EXPORT_CHOICES,
                        help="auto: a native Llama/Qwen2/Qwen3/Qwen3-MoE/OLMoE class when the checkpoint is one, "
                             "else the remote-code DLM class; or force one (an impossible choice is an error).")
    group = parser.add_argument_group("tokenizer (the one the checkpoint was trained with; its sha256 is checked)")
    group.add_argument("--tokenizer-model", help="SentencePiece .model, or tokenizer.json or its folder.")
    group.add_argument("--vocab-file", help="GPT-2 BPE vocab.json.")
    group.add_argument("--merge-file", help="GPT-2 BPE merges.txt.")
    group.add_argument("--no-tokenizer", action="store_true", help="Export the model without a tokenizer.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar (tqdm) over the layers.")
    return parser.parse_args(argv)


def progress_bar(total: int, enabled: bool, description: str) -> tqdm:
    return tqdm(total=total, desc=description, unit="layer", disable=not enabled)


def _default_dtype(saved_config: dict) -> torch.dtype:
    if saved_config.get("bf16"):
        return torch.bfloat16
    return torch.float16 if saved_config.get("fp16") else torch.float32


def _write_remote_code(output_dir: str) -> None:
    """Copy the DLM templates and the framework's torch-only files: the sampler, the CUDA-graph
    runner, the likelihood estimate and the RoPE frequencies."""
    for name in REMOTE_CODE:
        source = LIBRARY_CODE.get(name, TEMPLATES if name.endswith("_dlm.py") else INFERENCE)
        shutil.copyfile(os.path.join(source, name), os.path.join(output_dir, name))


def write_weights(iter_dir: str, config, output_dir: str, dtype: torch.dtype, max_shard_bytes: int,
                  progress: bool = True) -> List[str]:
    """Stream the checkpoint layer by layer into safetensors shards of HF-named tensors."""
    shapes = checkpoint_io.stored_shapes(iter_dir)
    writer = ShardedWriter(output_dir, max_shard_bytes)
    bar = progress_bar(config.num_layers + 1, progress, "converting")
    globals_ = checkpoint_io.read_tensors(iter_dir, mapping.global_names(config), shapes)
    hf = mapping.globals_to_hf(config, globals_)
    writer.add("model.embed_tokens.weight", hf.pop("model.embed_tokens.weight").to(dtype))
    bar.update()
    for index in range(config.num_layers):
        prefix = f"decoder.layers.{index}."
        names = [prefix + name for name in mapping.layer_names(config, index)]
        layer = checkpoint_io.read_tensors(iter_dir, names, shapes)
        converted = mapping.layer_to_hf(config, index, {name[len(prefix):]: t for name, t in layer.items()})
        for name, tensor in converted.items():
            writer.add(name, tensor.to(dtype))
        bar.update()
    for name, tensor in hf.items():  # final norm and lm_head last, as HF orders them
        writer.add(name, tensor.to(dtype))
    bar.close()
    return writer.close()


def _is_export_file(name: str) -> bool:
    return name in EXPORT_FILES or (name.startswith("model") and name.endswith(".safetensors"))


def check_save_folder(save: str) -> None:
    """An existing --save must be empty or an earlier export, since the export replaces the whole folder."""
    if not os.path.exists(save):
        return
    if not os.path.isdir(save):
        raise InputError(f"--save {save} is a file; choose a folder")
    names = os.listdir(save)
    folders = [name for name in names if os.path.isdir(os.path.join(save, name))]
    if names and (folders or "config.json" not in names):
        found = f"it holds the folder {folders[0]}" if folders else "it has no config.json"
        raise InputError(f"--save {save} is not empty and not an earlier export ({found}); an export replaces "
                         "the whole folder: choose a new or empty --save folder")


def _exchange(first: str, second: str) -> bool:
    """Swap two directories in one atomic step (Linux renameat2); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc older than 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    return renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0


def publish(staging: str, save: str) -> None:
    """Put the complete export `staging` at `save`: whoever reads `save`, at any moment, finds the
    old folder or the new one, whole (the module docstring has the one exception)."""
    if not os.path.exists(save):
        os.rename(staging, save)
        return
    for name in os.listdir(save):  # files no export writes (a README) stay; stale export files do not
        if not _is_export_file(name) and not os.path.lexists(os.path.join(staging, name)):
            shutil.copy2(os.path.join(save, name), os.path.join(staging, name), follow_symlinks=False)
    if _exchange(staging, save):
        shutil.rmtree(staging, ignore_errors=True)  # the old export now
        return
    old = f"{os.path.abspath(save)}.old-{os.getpid()}"
    os.rename(save, old)
    try:
        os.rename(staging, save)
    except BaseException:
        os.rename(old, save)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_export(source: dict, output_dir: str, args: argparse.Namespace) -> dict:
    """Every file of the export into `output_dir`; `source` is what convert read and checked."""
    config, dlm, identity, tokenizer, dtype = (source[key] for key in ("config", "dlm", "identity", "tokenizer",
                                                                        "dtype"))
    shards = write_weights(source["iter_dir"], config, output_dir, dtype, source["max_shard_bytes"],
                           progress=not args.no_progress)
    special = {"eos_token_id": identity.get("eod"), "pad_token_id": identity.get("eod"),
               "bos_token_id": None, "mask_token_id": identity.get("mask")}
    if tokenizer is not None:
        special = export_tokenizer(tokenizer, output_dir, config.max_position_embeddings)
    metadata = source["metadata"]
    provenance = {"source_checkpoint": os.path.abspath(source["iter_dir"]), "iteration": source["iteration"],
                  "seq_length": metadata.get("seq_length"), "dlm_config": metadata.get("dlm_config"),
                  "tokenizer": identity}
    if metadata["transformer_config"].get("moe"):  # the training-only MoE fields, for a later import
        provenance["moe_config"] = metadata["transformer_config"]["moe"]
    hf = hf_config.export_config(source["kind"], config, dlm, special, dtype, provenance)
    with open(os.path.join(output_dir, "config.json"), "w") as handle:
        json.dump(hf, handle, indent=2)
    generation = {key: special.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    with open(os.path.join(output_dir, "generation_config.json"), "w") as handle:
        json.dump({key: value for key, value in generation.items() if value is not None}, handle, indent=2)
    if source["kind"] == "dlm":
        _write_remote_code(output_dir)
    return {"architecture": hf["architectures"][0], "shards": shards, "dtype": str(dtype),
            "tokenizer": tokenizer is not None, "iteration": source["iteration"]}


def convert(args: argparse.Namespace) -> dict:
    """Check every input, build the export in a temporary sibling of --save, then publish it."""
    iter_dir, iteration = resolve_checkpoint(args.load, args.iteration)
    metadata = read_metadata(iter_dir)
    check_shard_files(iter_dir)
    config, dlm = configs_from_metadata(metadata)
    if config.position_embedding_type != "rope":
        raise InputError(f"--load {args.load}: the model has a {config.position_embedding_type} position table, "
                         "which the Hugging Face architectures written here (Llama, Qwen and the DLM class) do not "
                         "have; convert it to Megatron-LM's format instead (tools/weights_conversion/to_megatron.py)")
    identity = metadata.get("tokenizer") or {"type": "NullTokenizer"}
    source = dict(iter_dir=iter_dir, iteration=iteration, metadata=metadata, config=config, dlm=dlm,
                  identity=identity, kind=hf_config.choose_export(config, dlm, args.hf_architecture),
                  dtype=DTYPES[args.dtype] if args.dtype else _default_dtype(metadata["transformer_config"]),
                  max_shard_bytes=parse_size(args.max_shard_size), tokenizer=None)
    if not args.no_tokenizer:
        source["tokenizer"] = rebuild_training_tokenizer(identity, tokenizer_model=args.tokenizer_model,
                                                         vocab_file=args.vocab_file, merge_file=args.merge_file)
    check_save_folder(args.save)
    staging = f"{os.path.abspath(args.save)}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        summary = _write_export(source, staging, args)
        publish(staging, args.save)
    except BaseException:  # a damaged shard, a full disk, Ctrl-C: --save stays as it was
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        summary = convert(args)
    except (ValueError, OSError, TokenizerExportError) as error:  # InputError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"> wrote {summary['architecture']} (iteration {summary['iteration']}, {summary['dtype']}, "
          f"{len(summary['shards'])} shard(s)) to {args.save}")
    if not summary["tokenizer"]:
        print("> note: no tokenizer exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
