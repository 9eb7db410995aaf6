"""What a checkpoint's metadata says about the network, against this run's flags.

`check_compatible` refuses to `--load` a checkpoint whose network computes something else than
the one this run built: another shape (never loadable), or the same shapes computing another
function (rotary base and RoPE scaling, norm epsilon, activation, mask token, running mode, sliding
window, vocabulary), which `--finetune` accepts on purpose. `apply_checkpoint_args` is Megatron's
`--use-checkpoint-args`: the architecture flags are taken from the checkpoint, so a user need not
retype them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

from megatron.core.errors import InputError
from megatron.core.transformer.rope_scaling import FIELDS_OF_TYPE, SCALING_DEFAULTS
from megatron.core.transformer.transformer_config import RUNNING_MODES
from megatron.training.checkpoint_files import iteration_dir, latest_iteration, read_checkpoint_metadata
from megatron.training.megatron_lm_checkpoint import (is_megatron_lm_checkpoint, megatron_lm_architecture,
                                                      megatron_lm_iteration_dir, read_megatron_lm_args)
from megatron.training.rope_args import ROPE_FIELD_FLAGS, checkpoint_rope_flags

# TransformerConfig fields that decide the parameters' shapes: (the flag, checkpoint -> flag value).
ARCHITECTURE_FIELDS: Dict[str, Tuple[str, str, Callable]] = {
    "num_layers": ("--num-layers", "num_layers", lambda v: v),
    "hidden_size": ("--hidden-size", "hidden_size", lambda v: v),
    "num_attention_heads": ("--num-attention-heads", "num_attention_heads", lambda v: v),
    "num_query_groups": ("--num-query-groups", "num_query_groups", lambda v: v),
    "kv_channels": ("--kv-channels", "kv_channels", lambda v: v),
    "ffn_hidden_size": ("--ffn-hidden-size", "ffn_hidden_size", lambda v: v),
    "normalization": ("--normalization", "normalization", lambda v: v),
    "qk_layernorm": ("--qk-layernorm", "qk_layernorm", lambda v: v),
    "gated_linear_unit": ("--swiglu", "swiglu", lambda v: v),
    "share_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights",
                                            "untie_embeddings_and_output_weights", lambda v: not v),
    "add_bias_linear": ("--disable-bias-linear", "disable_bias_linear", lambda v: not v),
    "add_qkv_bias": ("--add-qkv-bias", "add_qkv_bias", lambda v: v),
    "qk_layernorm_scope": ("--qk-layernorm-scope", "qk_layernorm_scope", lambda v: v),
    # Not a shape, but the stored norm weights mean w or 1 + w: never reinterpreted, even by --finetune.
    "layernorm_zero_centered_gamma": ("--apply-layernorm-1p", "apply_layernorm_1p", lambda v: v),
    # A learned table or none (yarn is RoPE: checkpoint_rope_flags sets the flag's value).
    "position_embedding_type": ("--position-embedding-type", None, None),
}
# What checkpoints written before a field existed hold.
ARCHITECTURE_DEFAULTS = {"qk_layernorm_scope": "head", "layernorm_zero_centered_gamma": False,
                         "position_embedding_type": "rope"}
# MoEConfig fields (the checkpoint's `transformer_config.moe`) that decide the shapes, and those that
# change what the same weights compute; each field's flag is --moe-<field> (num_experts: --num-experts).
MOE_ARCHITECTURE_FIELDS = ("num_experts", "ffn_hidden_size", "shared_expert_intermediate_size", "layer_flags",
                           "router_enable_expert_bias")
MOE_FUNCTION_FIELDS = ("router_topk", "router_type", "router_score_function", "router_pre_softmax",
                       "router_topk_scaling_factor")


def _moe_flag(field: str) -> str:
    if field == "num_experts":
        return "--num-experts"
    return "--moe-layer-freq" if field == "layer_flags" else f"--moe-{field.replace('_', '-')}"
# Fields that change what the same weights compute; --finetune changes them on purpose.
FUNCTION_FIELDS: Dict[str, Tuple[str, str, Callable]] = {
    "layernorm_epsilon": ("--norm-epsilon", "norm_epsilon", lambda v: v),
    "activation": ("--swiglu", None, None),  # follows gated_linear_unit in this release
    "rotary_base": ("--rotary-base", "rotary_base", lambda v: v),
    "rotary_percent": ("--rotary-percent", "rotary_percent", lambda v: v),
}
DLM_FUNCTION_FIELDS = {"model_running_mode": "--model-running-mode", "mask_token_id": "--mask-token",
                       "attention_mask_type": "--attention-mask-type", "block_size": "--difflm-block-size",
                       "sliding_window": "--sliding-window", "block_diffusion": "--difflm-block-diffusion",
                       "causal_clean_half": "--difflm-ar-loss-weight"}


def _mismatch(source: str, field: str, flag: str, saved, current, changeable: bool) -> InputError:
    fix = ("pass the checkpoint's value, or --finetune to change it on purpose" if changeable else
           "use the checkpoint's architecture")
    return InputError(f"--load {source}: the checkpoint has {field}={saved!r} but this run has {current!r} "
                      f"({flag}); {fix} (--use-checkpoint-args takes the architecture from the checkpoint)")


def _dlm_function(dlm: dict, window) -> dict:
    """The DLM fields (and the sliding `window`) that matter for what the network computes, given its
    running mode: vanilla attends causally, or in a causal sliding window."""
    mask_type = dlm.get("attention_mask_type")
    if dlm.get("model_running_mode", "vanilla") == "vanilla":
        function = {"model_running_mode": "vanilla"}
        if mask_type == "sliding_window":
            function.update(attention_mask_type=mask_type, sliding_window=window)
        return function
    function = {"model_running_mode": dlm["model_running_mode"], "mask_token_id": dlm.get("mask_token_id"),
                "attention_mask_type": "causal" if mask_type == "causal_bottom_right" else mask_type}
    if mask_type == "block_causal" or dlm.get("block_diffusion"):
        function["block_size"] = dlm.get("block_size")
    if dlm.get("block_diffusion"):
        function["block_diffusion"] = True
        if (dlm.get("ar_loss_weight") or 0) > 0:  # the joint objective's token-causal clean half
            function["causal_clean_half"] = True
    if mask_type in ("sliding_window", "sliding_window_two_sided"):
        function["sliding_window"] = window
    return function


def _rope_function(config: dict) -> dict:
    """The RoPE-scaling fields its type reads (a checkpoint without them is unscaled)."""
    kind = config.get("rope_scaling_type", "none")
    fields = FIELDS_OF_TYPE.get(kind, FIELDS_OF_TYPE["none"])
    return {field: config.get(field, SCALING_DEFAULTS[field]) for field in fields}


def _check_rope(saved: dict, current: dict, source: str) -> None:
    saved_rope, current_rope = _rope_function(saved), _rope_function(current)
    for field in dict.fromkeys([*saved_rope, *current_rope]):
        if saved_rope.get(field) != current_rope.get(field):
            flag = ROPE_FIELD_FLAGS.get(field, f"--{field.replace('_', '-')}")
            raise _mismatch(source, field, flag, saved_rope.get(field), current_rope.get(field), changeable=True)


def check_compatible(record, finetune: bool, metadata: dict, source: str) -> None:
    """Raise InputError naming the first field where the checkpoint and this run (its
    `configs.RunRecord`) differ; `finetune` accepts a function change on purpose. The tokenizer
    comes first: another vocabulary also moves an appended mask token, and that is its cause."""
    _check_vocabulary(record, finetune, metadata, source)
    saved = metadata["transformer_config"]
    current = dataclasses.asdict(record.transformer_config)
    for field, (flag, _, _) in ARCHITECTURE_FIELDS.items():
        if saved.get(field, ARCHITECTURE_DEFAULTS.get(field)) != current[field]:
            raise _mismatch(source, field, flag, saved.get(field), current[field], changeable=False)
    if current["position_embedding_type"] == "learned_absolute":  # the table's rows are a shape
        if saved.get("max_position_embeddings") != current["max_position_embeddings"]:
            raise _mismatch(source, "max_position_embeddings", "--max-position-embeddings",
                            saved.get("max_position_embeddings"), current["max_position_embeddings"], changeable=False)
    _check_moe(saved.get("moe"), current["moe"], finetune, source)
    if not finetune:
        for field, (flag, _, _) in FUNCTION_FIELDS.items():
            if field in saved and saved[field] != current[field]:
                raise _mismatch(source, field, flag, saved[field], current[field], changeable=True)
        _check_rope(saved, current, source)
        saved_dlm = _dlm_function(metadata.get("dlm_config") or {}, saved.get("sliding_window"))
        # A block-size curriculum compares the size this run trains the checkpoint's last step with.
        at_saved = record.dlm_config.at_iteration(max(int(metadata.get("iteration") or 0) - 1, 0))
        current_dlm = _dlm_function(dataclasses.asdict(at_saved), current["sliding_window"])
        for field, flag in DLM_FUNCTION_FIELDS.items():
            if saved_dlm.get(field) != current_dlm.get(field):
                raise _mismatch(source, field, flag, saved_dlm.get(field), current_dlm.get(field), changeable=True)


def _check_moe(saved, current, finetune: bool, source: str) -> None:
    if (saved is None) != (current is None):
        raise _mismatch(source, "moe.num_experts", "--num-experts", saved and saved["num_experts"],
                        current and current["num_experts"], changeable=False)
    if saved is None:
        return
    for fields, changeable in ((MOE_ARCHITECTURE_FIELDS, False), (() if finetune else MOE_FUNCTION_FIELDS, True)):
        for field in fields:
            if saved.get(field) != current[field]:
                raise _mismatch(source, f"moe.{field}", _moe_flag(field), saved.get(field), current[field],
                                changeable)


def _apply_moe(args, saved) -> None:
    """The checkpoint's MoE fields as flags (none for a dense checkpoint)."""
    if not saved:
        return
    for field in MOE_ARCHITECTURE_FIELDS + MOE_FUNCTION_FIELDS:
        if field == "layer_flags":
            args.moe_layer_freq = "[" + ",".join(str(flag) for flag in saved[field]) + "]"
        elif field in saved:
            setattr(args, _moe_flag(field)[2:].replace("-", "_"), saved[field])


def _check_vocabulary(record, finetune: bool, metadata: dict, source: str) -> None:
    saved_tokenizer, tokenizer = metadata.get("tokenizer"), record.tokenizer
    if saved_tokenizer and tokenizer:
        if saved_tokenizer.get("sha256") != tokenizer.get("sha256"):
            raise InputError(f"--load {source}: the checkpoint was trained with another tokenizer "
                             f"({saved_tokenizer}); pass the same --tokenizer-model")
        # Tokenizers without files (NullTokenizer) hash alike: their size and special ids tell them apart.
        for field, flag in (("vocab_size", "--vocab-size"), ("eod", "--tokenizer-type or --null-tokenizer-eod-id"),
                            ("mask", "--mask-token")):
            if field in saved_tokenizer and saved_tokenizer[field] != tokenizer.get(field) and not finetune:
                raise InputError(f"--load {source}: the checkpoint's tokenizer has {field}="
                                 f"{saved_tokenizer[field]!r} but this run's has {tokenizer.get(field)!r} ({flag}); "
                                 "use the checkpoint's tokenizer, or --finetune to change it on purpose")
    saved = metadata["transformer_config"]
    # More stored rows than this tokenizer has (Hugging Face models pad their embeddings, e.g. Qwen's
    # 151,936 rows for 151,665 tokens) load as padding. Fewer (tokens added, say a mask token) leave
    # the new rows at their initialisation: only for a new run.
    saved_rows, vocab = saved.get("unpadded_vocab_size"), record.transformer_config.unpadded_vocab_size
    if saved_rows is not None and vocab is not None and saved_rows < vocab and not finetune:
        raise InputError(f"--load {source}: the checkpoint has {saved_rows} vocabulary rows but this run's "
                         f"tokenizer has {vocab} tokens; pass --finetune to start from it with the new rows "
                         "initialised")


def _apply_recorded_dlm(args, recorded) -> None:
    """A MegaDLMs run (and our to_megatron export) records its DLM flags in common.pt beside Megatron-LM's:
    `model_running_mode` and `mask_token`, taken as our own checkpoints' are (a --mask-token given is kept:
    --finetune may change it). Megatron-LM's AR runs record neither: the run's flags stand."""
    mode = getattr(recorded, "model_running_mode", None)
    if mode is None or not hasattr(args, "model_running_mode"):
        return
    if mode not in RUNNING_MODES:
        raise InputError(f"the checkpoint's --model-running-mode {mode} (MegaDLMs) is not a training mode here "
                         f"({', '.join(RUNNING_MODES)}); it cannot be continued")
    args.model_running_mode = mode
    if mode != "vanilla" and getattr(args, "mask_token", None) is None:
        args.mask_token = getattr(recorded, "mask_token", None)


def apply_checkpoint_args(args) -> None:
    """--use-checkpoint-args: the architecture flags (and --seq-length when not given) from the
    latest checkpoint under --load, before the flags are validated."""
    if not args.load:
        raise InputError("--use-checkpoint-args needs --load DIR")
    if is_megatron_lm_checkpoint(args.load):  # the run's args as Megatron-LM recorded them in common.pt
        recorded = read_megatron_lm_args(megatron_lm_iteration_dir(args.load))
        for dest, value in megatron_lm_architecture(recorded).items():
            setattr(args, dest, value)
        if args.seq_length is None:
            args.seq_length = getattr(recorded, "seq_length", None)
        _apply_recorded_dlm(args, recorded)
        return
    iteration = latest_iteration(args.load)
    if iteration is None:
        raise InputError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint yet (no tracker file); "
                         "give the architecture flags")
    metadata = read_checkpoint_metadata(iteration_dir(args.load, iteration))
    saved = metadata.get("transformer_config", {})
    for field, (_, dest, to_flag) in {**ARCHITECTURE_FIELDS, **FUNCTION_FIELDS}.items():
        if dest is not None and field in saved:
            setattr(args, dest, to_flag(saved[field]))
    if "num_query_groups" in saved and "num_attention_heads" in saved:
        args.group_query_attention = saved["num_query_groups"] != saved["num_attention_heads"]
    if saved.get("sliding_window") is not None:
        args.sliding_window = saved["sliding_window"]
    _apply_moe(args, saved.get("moe"))
    checkpoint_rope_flags(args, saved)
    if saved.get("position_embedding_type") == "learned_absolute" and args.max_position_embeddings is None:
        args.max_position_embeddings = saved["max_position_embeddings"]  # the table's rows
    if args.seq_length is None and metadata.get("seq_length"):
        args.seq_length = metadata["seq_length"]
    dlm = metadata.get("dlm_config") or {}
    if hasattr(args, "model_running_mode") and dlm.get("model_running_mode"):
        args.model_running_mode = dlm["model_running_mode"]
        if dlm["model_running_mode"] != "vanilla" or dlm.get("attention_mask_type") == "sliding_window":
            args.attention_mask_type = dlm.get("attention_mask_type", args.attention_mask_type)
            if dlm.get("attention_mask_type") == "block_causal":
                args.difflm_block_size = dlm.get("block_size")
        if dlm.get("block_diffusion") and hasattr(args, "difflm_block_diffusion"):
            args.difflm_block_diffusion, args.difflm_block_size = True, dlm.get("block_size")
            if (dlm.get("ar_loss_weight") or 0) > 0 and not getattr(args, "difflm_ar_loss_weight", 0):
                args.difflm_ar_loss_weight = dlm["ar_loss_weight"]  # its clean half's causal attention
