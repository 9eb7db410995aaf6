"""Convert a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / OLMoE folder (or a MegaDLMs export) to a
MegaDLMs checkpoint.

    python tools/weights_conversion/hf_to_megatron.py --hf-path HF_DIR --save CKPT_DIR \
        [--tensor-model-parallel-size N] [--model-running-mode difflm-shift --mask-token-id ID]

Writes CKPT_DIR/iter_0000000/ (DCP shards of the model, metadata.json) and
latest_checkpointed_iteration.txt. Continue training with the same architecture flags and
`pretrain_difflm.py --load CKPT_DIR --finetune` (weights only, iteration 0); `--model-running-mode
difflm-shift` adapts an AR model into a diffusion LM (position i keeps predicting token i+1).
Any layout loads any checkpoint (loading reshards), so --tensor-model-parallel-size only picks
the layout written: N > 1 spawns N gloo processes on CPU that write the shards a TP=N run would
(and pads the vocabulary as that run does); 1 (default) writes whole tensors from one process.

A bad input (an unreadable or truncated HF file, a --save that already holds a checkpoint) is
one line `error: ...` before any weight is converted. The iteration is staged and renamed into
place, the tracker written last (checkpoint_io.write_checkpoint), so a failure or a kill never
leaves a tracker naming an incomplete iteration and never touches an existing checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.transformer.transformer_config import (ATTENTION_MASK_TYPES, RUNNING_MODES,  # noqa: E402
                                                          DLMConfig, TransformerConfig)
from tools.weights_conversion import checkpoint_io, hf_config, mapping  # noqa: E402
from tools.weights_conversion.megatron_to_hf import progress_bar  # noqa: E402
from tools.weights_conversion.safetensors_io import LazyWeights, read_config  # noqa: E402

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--hf-path", required=True, help="Hugging Face folder (config.json + safetensors).")
    parser.add_argument("--save", required=True, help="Output checkpoint directory (as for --save in training).")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="Layout of the written shards (any layout loads it).")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="Vocabulary padding recorded for the layout (as the training flag).")
    parser.add_argument("--model-running-mode", choices=RUNNING_MODES,
                        help="Objective to continue with (default: vanilla for AR models, the export's own mode "
                             "for MegaDLMs exports); difflm-shift adapts an AR model to a DLM.")
    parser.add_argument("--attention-mask-type", choices=ATTENTION_MASK_TYPES,
                        help="Attention of the DLM modes (default no_mask, bidirectional).")
    parser.add_argument("--mask-token-id", type=int, help="Mask token of the DLM modes (default: the "
                        "tokenizer's mask token, if the folder's tokenizer has one).")
    parser.add_argument("--max-position-embeddings", type=int, help="Override the RoPE table length.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar (tqdm) over the layers.")
    return parser.parse_args(argv)


def _bias_presence(weights: LazyWeights) -> dict:
    """Which bias tensors the layers hold (layer 0 speaks for all; its MLP may be experts). MegaDLMs
    has no biases, QKV-only biases or biases everywhere; an all-zero o_proj/MLP bias is dropped when
    that makes the set one of those (e.g. Llama's attention_bias without mlp_bias, when o_proj's bias
    is unused)."""
    prefix = "model.layers.0."
    mlp = prefix + "mlp.down_proj.bias"
    names = {"qkv": prefix + "self_attn.q_proj.bias", "o_proj": prefix + "self_attn.o_proj.bias",
             "mlp": mlp if mlp in weights else prefix + "mlp.experts.0.down_proj.bias"}
    present = {kind: name in weights for kind, name in names.items()}
    if len(set(present.values())) == 1 or present == {"qkv": True, "o_proj": False, "mlp": False}:
        return present
    return {kind: exists and (kind == "qkv" or bool(weights.get(names[kind]).any()))
            for kind, exists in present.items()}


def _tokenizer_identity(hf_path: str, add_mask: bool, mask_token_id: Optional[int]) -> Optional[dict]:
    """The identity our HuggingFaceTokenizer gives the folder's tokenizer.json (what training with
    `--tokenizer-model HF_DIR` will compare against), with the files recorded; None without one."""
    if not os.path.isfile(os.path.join(hf_path, "tokenizer.json")):
        return None
    from megatron.training.tokenizer import HuggingFaceTokenizer

    try:
        tokenizer = HuggingFaceTokenizer(hf_path, add_mask_token=add_mask, mask_token=mask_token_id)
    except ValueError:  # e.g. a mask id among the model's rows beyond the tokenizer's vocabulary
        tokenizer = HuggingFaceTokenizer(hf_path)
    return {**tokenizer.identity, "files": [os.path.abspath(path) for path in tokenizer._source_files()]}


def _dlm_config(args, fields: dict, config: TransformerConfig, hf_path: str) -> DLMConfig:
    mode, vocab = args.model_running_mode or fields.get("model_running_mode", "vanilla"), config.vocab_size
    values = {**fields, "model_running_mode": mode}
    if mode != "vanilla" and fields.get("model_running_mode") == "vanilla":
        values.pop("attention_mask_type", None)  # an AR model's causal window is not the DLM modes' default
    if args.attention_mask_type:
        values["attention_mask_type"] = args.attention_mask_type
    if args.mask_token_id is not None:
        values["mask_token_id"] = args.mask_token_id
    if mode != "vanilla" and values.get("mask_token_id") is None:
        identity = _tokenizer_identity(hf_path, add_mask=False, mask_token_id=None)
        values["mask_token_id"] = identity.get("mask") if identity else None
        if values["mask_token_id"] is None:
            raise ValueError(f"--model-running-mode {mode} needs a mask token and the folder's tokenizer has none; "
                             f"pass --mask-token-id ID (an id below the vocabulary size {vocab})")
    dlm = DLMConfig(**hf_config.dataclass_fields(DLMConfig, values))
    dlm.validate(vocab, sliding_window=config.sliding_window)
    return dlm


def convert(args: argparse.Namespace) -> str:
    if args.tensor_model_parallel_size < 1:
        raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} must be at least 1")
    checkpoint_io.check_save_target(args.save, 0)
    hf = read_config(args.hf_path)
    weights = LazyWeights(args.hf_path)
    architecture, fields, dlm_fields = hf_config.import_configs(
        hf, _bias_presence(weights), "lm_head.weight" in weights)
    if args.max_position_embeddings:
        fields["max_position_embeddings"] = args.max_position_embeddings
    config = TransformerConfig(**fields).validate()
    dlm = _dlm_config(args, dlm_fields, config, args.hf_path)
    fused = mapping.has_fused_experts(weights.names())  # transformers 5's in-memory expert layout
    expected = set(mapping.hf_names(config, fused))
    unexpected = sorted(name for name in weights.names()
                        if name not in expected and not name.endswith(_IGNORED_SUFFIXES)
                        and not (name == "lm_head.weight" and config.share_embeddings_and_output_weights))
    zero_biases = {name for name in unexpected if name.endswith(("o_proj.bias", "down_proj.bias", "gate_proj.bias",
                                                                  "up_proj.bias")) and not weights.get(name).any()}
    unexpected = [name for name in unexpected if name not in zero_biases]
    if unexpected:
        raise ValueError(f"{args.hf_path}: tensor {unexpected[0]} ({len(unexpected)} in all) has no place in the "
                         f"{architecture} layout this config describes; is config.json the weights' config?")
    missing = sorted(expected - set(weights.names()))
    if missing:
        raise ValueError(f"{args.hf_path}: the weights lack tensor {missing[0]} ({len(missing)} missing) that the "
                         f"{architecture} config implies")
    tensors = {name: tensor.float() for name, tensor in mapping.globals_from_hf(config, weights.get).items()}
    bar = progress_bar(config.num_layers, not args.no_progress, "reading")
    for index in range(config.num_layers):
        layer = mapping.layer_from_hf(config, index, weights.get, fused)
        tensors.update({f"decoder.layers.{index}.{name}": tensor.float() for name, tensor in layer.items()})
        bar.update()
    bar.close()
    tp = args.tensor_model_parallel_size
    layout = checkpoint_io.padded_config(config, tp, args.make_vocab_size_divisible_by)
    if tp > 1:
        _check_tensor_parallel(layout, tp)
    # A MegaDLMs export records the training tokenizer's identity: keep it, so the same training
    # flags pass the tokenizer check; otherwise describe the folder's own tokenizer.json.
    tokenizer = (hf.get("megadlms") or {}).get("tokenizer") or _tokenizer_identity(
        args.hf_path, add_mask=False, mask_token_id=dlm.mask_token_id if dlm.is_diffusion else None)
    source = {"hf_path": os.path.abspath(args.hf_path), "architecture": architecture}
    metadata = checkpoint_io.metadata_for(layout, dlm, tp, tokenizer, None, source)
    return checkpoint_io.write_checkpoint(args.save, tensors, metadata, tp)


def _check_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    groups = config.num_query_groups
    problems = []
    if config.num_attention_heads % tp:
        problems.append(f"num_attention_heads={config.num_attention_heads}")
    if groups % tp and (tp % groups or (tp // groups) % 2):
        problems.append(f"num_key_value_heads={groups}")
    dense = not all(mapping.is_moe_layer(config, index) for index in range(config.num_layers))
    if dense and config.ffn_hidden_size % tp:  # the experts are not split over tp (expert tp is 1)
        problems.append(f"intermediate_size={config.ffn_hidden_size}")
    shared = config.moe.shared_expert_intermediate_size if config.moe is not None else None
    if shared and shared % tp:
        problems.append(f"shared_expert_intermediate_size={shared}")
    if problems:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {', '.join(problems)}; choose another "
                         "size (or 1: any layout loads a TP=1 checkpoint)")


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        target = convert(args)
    except (ValueError, OSError, KeyError) as error:  # InputError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"> wrote {target} (tensor-parallel layout {args.tensor_model_parallel_size}); continue with "
          f"pretrain_difflm.py --load {args.save} --finetune and the same architecture flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
