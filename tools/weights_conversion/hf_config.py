"""Hugging Face `config.json` <-> MegaDLMs TransformerConfig / DLMConfig.

Export picks the most portable class that computes exactly what the checkpoint does:
native `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` (no remote code) for
autoregressive (`vanilla`) checkpoints of those architectures, otherwise the remote-code
`DLMForCausalLM` (hf_dlm/), which covers every architecture MegaDLMs trains. config.json is
written by hand, with both `rope_theta` and `rope_parameters`, so transformers 4.x and 5.x
read the same RoPE base.

Import accepts the architectures in SUPPORTED_IMPORTS and rejects, with the reason, any option
MegaDLMs cannot reproduce (RoPE scaling, another activation, sliding-window attention, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig

DLM_ARCHITECTURE = "DLMForCausalLM"
NATIVE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_IMPORTS = {
    "LlamaForCausalLM": "Llama (RMSNorm, SwiGLU, RoPE, GQA)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (Llama + QKV bias)",
    "Qwen3ForCausalLM": "Qwen3 (Llama + per-head QK-RMSNorm)",
    DLM_ARCHITECTURE: "MegaDLMs export (remote code, any running mode)",
}
EXPORT_CHOICES = ("auto", "llama", "qwen2", "qwen3", "dlm")


class UnsupportedArchitecture(ValueError):
    pass


def supported_imports_text() -> str:
    return "; ".join(f"{name} ({what})" for name, what in SUPPORTED_IMPORTS.items())


# ---------------------------------------------------------------------- export
def _common_mismatches(config: TransformerConfig, dlm: DLMConfig) -> List[str]:
    reasons = []
    if dlm.model_running_mode != "vanilla":
        reasons.append(f"model_running_mode={dlm.model_running_mode} (native classes are autoregressive)")
    if config.normalization != "RMSNorm":
        reasons.append(f"normalization={config.normalization}")
    if not config.gated_linear_unit or config.activation != "silu":
        reasons.append("the MLP is not SwiGLU")
    if config.rotary_percent != 1.0:
        reasons.append(f"rotary_percent={config.rotary_percent}")
    return reasons


def native_mismatches(kind: str, config: TransformerConfig, dlm: DLMConfig) -> List[str]:
    """Why `kind` (llama, qwen2, qwen3) cannot represent this checkpoint; empty when it can."""
    reasons = _common_mismatches(config, dlm)
    if kind == "qwen3":
        if not config.qk_layernorm:
            reasons.append("Qwen3 has QK-norm, the checkpoint has not")
        if config.add_bias_linear or config.add_qkv_bias:
            reasons.append("biases (Qwen3 export supports none)")
    else:
        if config.qk_layernorm:
            reasons.append(f"qk_layernorm ({kind} has no QK-norm)")
        if kind == "llama" and config.add_qkv_bias and not config.add_bias_linear:
            reasons.append("QKV-only bias (that is Qwen2)")
        if kind == "qwen2":
            if not config.add_qkv_bias or config.add_bias_linear:
                reasons.append("Qwen2 has a bias on q/k/v only")
            if config.kv_channels * config.num_attention_heads != config.hidden_size:
                reasons.append("head_dim != hidden_size / num_attention_heads")
    return reasons


def choose_export(config: TransformerConfig, dlm: DLMConfig, requested: str = "auto") -> str:
    """llama / qwen2 / qwen3 / dlm. `auto` takes a native class when one fits exactly."""
    if requested == "dlm":
        return "dlm"
    if requested != "auto":
        reasons = native_mismatches(requested, config, dlm)
        if reasons:
            raise UnsupportedArchitecture(
                f"--hf-architecture {requested} cannot represent this checkpoint: {'; '.join(reasons)}. Native "
                f"exports: {', '.join(f'{k} ({v})' for k, v in NATIVE_ARCHITECTURES.items())} for vanilla (AR) "
                "checkpoints; use --hf-architecture dlm (remote code) or auto for anything else")
        return requested
    for kind in ("qwen3", "llama", "qwen2"):
        if not native_mismatches(kind, config, dlm):
            return kind
    return "dlm"


def _rope_fields(kind: str, config: TransformerConfig) -> dict:
    if kind == "dlm":
        return {"rope_theta": config.rotary_base}
    # transformers 4.x reads rope_theta, 5.x rope_parameters: write both, equal.
    return {"rope_theta": config.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base}}


def export_config(kind: str, config: TransformerConfig, dlm: DLMConfig, special_ids: Dict[str, Optional[int]],
                  dtype: torch.dtype, provenance: dict) -> dict:
    """config.json of an export of `kind`."""
    vocab = config.unpadded_vocab_size or config.vocab_size
    common = {"vocab_size": vocab, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
              "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
              "hidden_act": config.activation, "max_position_embeddings": config.max_position_embeddings,
              "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
              "tie_word_embeddings": config.share_embeddings_and_output_weights, **_rope_fields(kind, config),
              "attention_dropout": 0.0, "use_cache": kind != "dlm",
              "bos_token_id": special_ids.get("bos_token_id"), "eos_token_id": special_ids.get("eos_token_id"),
              "pad_token_id": special_ids.get("pad_token_id"),
              "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", "")}
    if kind == "llama":
        specific = {"model_type": "llama", "attention_bias": config.add_bias_linear,
                    "mlp_bias": config.add_bias_linear, "pretraining_tp": 1}
    elif kind in ("qwen2", "qwen3"):
        specific = {"model_type": kind, "use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": config.num_layers, "layer_types": ["full_attention"] * config.num_layers}
        if kind == "qwen3":
            specific["attention_bias"] = False
    else:
        specific = {"model_type": "megadlm", "gated_mlp": config.gated_linear_unit,
                    "normalization": config.normalization, "qk_norm": config.qk_layernorm,
                    "qkv_bias": config.add_bias_linear or config.add_qkv_bias,
                    "o_proj_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
                    "rotary_percent": config.rotary_percent, "model_running_mode": dlm.model_running_mode,
                    "attention_mask_type": dlm.effective_mask_type,
                    "attention_block_size": dlm.block_size if dlm.effective_mask_type == "block_causal" else None,
                    "sliding_window": config.sliding_window if dlm.effective_mask_type == "sliding_window" else None,
                    "mask_token_id": dlm.mask_token_id if dlm.is_diffusion else special_ids.get("mask_token_id"),
                    "auto_map": {"AutoConfig": "configuration_dlm.DLMConfig",
                                 "AutoModel": "modeling_dlm.DLMModel",
                                 "AutoModelForCausalLM": "modeling_dlm.DLMForCausalLM"}}
    architecture = DLM_ARCHITECTURE if kind == "dlm" else NATIVE_ARCHITECTURES[kind]
    return {"architectures": [architecture], **common, **specific, "megadlms": provenance}


# ---------------------------------------------------------------------- import
def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_IMPORTS:
        found = architectures or [hf.get("model_type", "unknown")]
        raise UnsupportedArchitecture(f"unsupported architecture {', '.join(map(str, found))}; supported: "
                                      f"{supported_imports_text()}")
    return architectures[0]


def _rope(hf: dict) -> Tuple[float, float]:
    """(rope base, rotary fraction); RoPE scaling variants are rejected."""
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source in (parameters, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in ("default", None):
            raise UnsupportedArchitecture(f"RoPE scaling {kind!r} is not supported (MegaDLMs' RoPE is unscaled); "
                                          "supported: the default rope_type")
    theta = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_percent", 1.0)))
    return float(theta), float(fraction)


def import_configs(hf: dict, biases: Dict[str, bool], has_lm_head: bool) -> Tuple[str, dict, dict]:
    """(architecture, TransformerConfig fields, DLMConfig fields) of an HF config.json.

    `biases` says which bias tensors the weights hold ({'qkv', 'o_proj', 'mlp'} -> bool, an
    all-zero o_proj bias counting as absent); `has_lm_head` whether lm_head.weight exists.
    """
    architecture = _architecture(hf)
    is_dlm = architecture == DLM_ARCHITECTURE
    act = hf.get("hidden_act", "silu")
    if not is_dlm and act != "silu":
        raise UnsupportedArchitecture(f"hidden_act={act!r} is not supported for {architecture}; supported: silu")
    if hf.get("use_sliding_window") or (architecture == "LlamaForCausalLM" and hf.get("sliding_window")):
        raise UnsupportedArchitecture(f"{architecture} with sliding-window attention is not supported; "
                                      "supported: full attention")
    theta, fraction = _rope(hf)
    heads = hf["num_attention_heads"]
    qkv, o_proj, mlp = biases["qkv"], biases["o_proj"], biases["mlp"]
    if o_proj != qkv or mlp != qkv:
        if qkv and not o_proj and not mlp:
            pass  # QKV-only bias (Qwen2): add_qkv_bias
        else:
            raise UnsupportedArchitecture(f"{architecture} with biases on qkv={qkv}, o_proj={o_proj}, mlp={mlp} is "
                                          "not supported; supported: no biases, QKV-only, or all linear layers")
    tied = bool(hf.get("tie_word_embeddings", not has_lm_head))
    if tied and has_lm_head:
        tied = False  # a separate lm_head tensor wins over the flag: keep it
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                  ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
                  num_query_groups=hf.get("num_key_value_heads") or heads,
                  kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
                  vocab_size=hf["vocab_size"], unpadded_vocab_size=hf["vocab_size"],
                  max_position_embeddings=hf.get("max_position_embeddings", 4096),
                  normalization=hf.get("normalization", "RMSNorm"),
                  layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                  qk_layernorm=architecture == "Qwen3ForCausalLM" or bool(hf.get("qk_norm")),
                  add_bias_linear=qkv and o_proj and mlp, add_qkv_bias=qkv and not (o_proj and mlp),
                  gated_linear_unit=bool(hf.get("gated_mlp", True)), activation=act,
                  rotary_base=theta, rotary_percent=fraction,
                  init_method_std=hf.get("initializer_range", 0.02), share_embeddings_and_output_weights=tied)
    dlm_fields = {"model_running_mode": "vanilla"}
    if is_dlm:
        mode = hf.get("model_running_mode", "difflm-noshift")
        mask_type = hf.get("attention_mask_type", "causal" if mode == "vanilla" else "no_mask")
        fields["sliding_window"] = hf.get("sliding_window") if mask_type == "sliding_window" else None
        dlm_fields = {"model_running_mode": mode, "attention_mask_type": "no_mask" if mode == "vanilla" else mask_type,
                      "mask_token_id": hf.get("mask_token_id"), "block_size": hf.get("attention_block_size")}
        dlm_fields.update((hf.get("megadlms") or {}).get("dlm_config") or {})
    return architecture, fields, dlm_fields


def dataclass_fields(cls, values: dict) -> dict:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in values.items() if key in names}
