"""Convert a MegaDLMs training checkpoint (any tensor/data-parallel layout) to a Hugging Face folder.

    python tools/weights_conversion/megatron_to_hf.py --load CKPT_DIR [--iteration N] --save HF_DIR \
        [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer-model spm.model] [--hf-architecture auto]

Writes safetensors shards (+ index when sharded), config.json with every architecture field from the
checkpoint's metadata, generation_config.json and the training tokenizer (tokenizer.json,
tokenizer_config.json, and the original files). Autoregressive (`vanilla`) checkpoints of the Llama,
Qwen2 or Qwen3 architecture become native LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
folders; everything else (every difflm-* mode) gets the remote-code DLMForCausalLM
(configuration_dlm.py, modeling_dlm.py, and generation.py, cuda_graphs.py, likelihood.py), loaded with
`AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import List, Optional

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.weights_conversion import checkpoint_io, hf_config, mapping  # noqa: E402
from tools.weights_conversion.safetensors_io import ShardedWriter, parse_size  # noqa: E402
from tools.weights_conversion.tokenizer_export import (TokenizerExportError, export_tokenizer,  # noqa: E402
                                                       rebuild_training_tokenizer)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_dlm")
INFERENCE = os.path.join(REPO_ROOT, "megatron", "core", "inference")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory written by --save (or an iter_ folder).")
    parser.add_argument("--iteration", type=int, help="Iteration to convert (default: the latest).")
    parser.add_argument("--save", required=True, help="Output Hugging Face folder.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="Weight dtype (default: bfloat16 if the run "
                        "trained with --bf16, float16 with --fp16, else float32).")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard (e.g. 5GB, 500MB).")
    parser.add_argument("--hf-architecture", default="auto", choices=hf_config.EXPORT_CHOICES,
                        help="auto: a native Llama/Qwen2/Qwen3 class when the checkpoint is one, else the "
                             "remote-code DLM class; or force one (an impossible choice is an error).")
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
    """Copy the DLM templates and the framework's torch-only inference files: the sampler, the
    CUDA-graph runner and the likelihood estimate."""
    for name in ("configuration_dlm.py", "modeling_dlm.py"):
        shutil.copyfile(os.path.join(TEMPLATES, name), os.path.join(output_dir, name))
    for name in ("generation.py", "cuda_graphs.py", "likelihood.py"):
        shutil.copyfile(os.path.join(INFERENCE, name), os.path.join(output_dir, name))


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
        layer = checkpoint_io.read_tensors(iter_dir, [prefix + name for name in mapping.layer_names(config)], shapes)
        converted = mapping.layer_to_hf(config, index, {name[len(prefix):]: t for name, t in layer.items()})
        for name, tensor in converted.items():
            writer.add(name, tensor.to(dtype))
        bar.update()
    for name, tensor in hf.items():  # final norm and lm_head last, as HF orders them
        writer.add(name, tensor.to(dtype))
    bar.close()
    return writer.close()


def convert(args: argparse.Namespace) -> dict:
    iter_dir, iteration = checkpoint_io.resolve_checkpoint(args.load, args.iteration)
    metadata = checkpoint_io.read_metadata(iter_dir)
    config, dlm = checkpoint_io.configs_from_metadata(metadata)
    kind = hf_config.choose_export(config, dlm, args.hf_architecture)
    dtype = DTYPES[args.dtype] if args.dtype else _default_dtype(metadata["transformer_config"])
    identity = metadata.get("tokenizer") or {"type": "NullTokenizer"}
    tokenizer = None
    if not args.no_tokenizer:
        tokenizer = rebuild_training_tokenizer(identity, tokenizer_model=args.tokenizer_model,
                                               vocab_file=args.vocab_file, merge_file=args.merge_file)
    os.makedirs(args.save, exist_ok=True)
    for name in os.listdir(args.save):  # weights of an earlier export would mix with these
        if name.startswith("model") and (name.endswith(".safetensors") or name == "model.safetensors.index.json"):
            os.remove(os.path.join(args.save, name))
    shards = write_weights(iter_dir, config, args.save, dtype, parse_size(args.max_shard_size),
                           progress=not args.no_progress)
    special = {"eos_token_id": identity.get("eod"), "pad_token_id": identity.get("eod"),
               "bos_token_id": None, "mask_token_id": identity.get("mask")}
    if tokenizer is not None:
        special = export_tokenizer(tokenizer, args.save, config.max_position_embeddings)
    provenance = {"source_checkpoint": os.path.abspath(iter_dir), "iteration": iteration,
                  "seq_length": metadata.get("seq_length"), "dlm_config": metadata.get("dlm_config"),
                  "tokenizer": identity}
    hf = hf_config.export_config(kind, config, dlm, special, dtype, provenance)
    with open(os.path.join(args.save, "config.json"), "w") as handle:
        json.dump(hf, handle, indent=2)
    generation = {key: special.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    with open(os.path.join(args.save, "generation_config.json"), "w") as handle:
        json.dump({key: value for key, value in generation.items() if value is not None}, handle, indent=2)
    if kind == "dlm":
        _write_remote_code(args.save)
    return {"architecture": hf["architectures"][0], "shards": shards, "dtype": str(dtype),
            "tokenizer": tokenizer is not None, "iteration": iteration}


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        summary = convert(args)
    except (ValueError, FileNotFoundError, TokenizerExportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"> wrote {summary['architecture']} (iteration {summary['iteration']}, {summary['dtype']}, "
          f"{len(summary['shards'])} shard(s)) to {args.save}")
    if not summary["tokenizer"]:
        print("> note: no tokenizer exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
