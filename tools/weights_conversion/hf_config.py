"""Hugging Face `config.json` <-> MegaDLMs TransformerConfig / DLMConfig.

Export picks the most portable class that computes exactly what the checkpoint does:
native `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`, or for mixture-of-experts
checkpoints `Qwen3MoeForCausalLM` / `OlmoeForCausalLM` (no remote code), for autoregressive
(`vanilla`) checkpoints of those architectures, otherwise the remote-code `DLMForCausalLM`
(hf_dlm/), which covers every architecture MegaDLMs trains (shared experts, expert biases and
the expert-bias balancing, sigmoid scores, expert-choice routing, capacity limits included).
config.json is written by hand, with both `rope_theta` and `rope_parameters` (and `rope_scaling`
when scaled), so transformers 4.x and 5.x read the same RoPE. RoPE scaling (llama3, yarn) and
sliding-window attention: hf_rope.py.

MoE fields: `num_experts`, `num_experts_per_tok` (router_topk), `moe_intermediate_size` (Qwen3-MoE;
OLMoE's `intermediate_size`: the experts' ffn), `norm_topk_prob` (= not router_pre_softmax),
`decoder_sparse_step` + `mlp_only_layers` (the 0/1 list `layer_freq`; OLMoE: every layer),
`router_aux_loss_coef` (aux_loss_coeff, a training-only weight whose normalisation differs
between the two frameworks). OLMoE's QK-norm covers the whole q / k projection:
`qk_layernorm_scope='all'`.

Import accepts the architectures in SUPPORTED_IMPORTS and rejects, with the reason, any option
MegaDLMs cannot reproduce (RoPE scaling other than llama3 / yarn, another activation, a sliding
window in only some layers, QKV clipping, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.transformer.moe.config import MoEConfig
from megatron.core.transformer.transformer_config import WINDOW_MASK_TYPES, DLMConfig, TransformerConfig
from tools.weights_conversion import hf_rope
from tools.weights_conversion.hf_rope import UnsupportedArchitecture

DLM_ARCHITECTURE = "DLMForCausalLM"
NATIVE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
MOE_KINDS = ("qwen3_moe", "olmoe")
SUPPORTED_IMPORTS = {
    "LlamaForCausalLM": "Llama (RMSNorm, SwiGLU, RoPE, GQA)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (Llama + QKV bias)",
    "Qwen3ForCausalLM": "Qwen3 (Llama + per-head QK-RMSNorm)",
    "Qwen3MoeForCausalLM": "Qwen3-MoE (Qwen3 + top-k experts, optional dense layers)",
    "OlmoeForCausalLM": "OLMoE (top-k experts in every layer, full-width QK-RMSNorm)",
    DLM_ARCHITECTURE: "MegaDLMs export (remote code, any running mode, MoE included)",
}
EXPORT_CHOICES = ("auto", "llama", "qwen2", "qwen3", "qwen3_moe", "olmoe", "dlm")


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


def _dense_mismatches(kind: str, config: TransformerConfig) -> List[str]:
    reasons = []
    if config.moe is not None:
        reasons.append(f"MoE layers ({kind} is dense; the MoE classes are {', '.join(MOE_KINDS)})")
    if kind == "qwen3":
        if not config.qk_layernorm:
            reasons.append("Qwen3 has QK-norm, the checkpoint has not")
        elif config.qk_layernorm_scope != "head":
            reasons.append(f"qk_layernorm_scope={config.qk_layernorm_scope} (Qwen3 normalises each head)")
        if config.add_bias_linear or config.add_qkv_bias:
            reasons.append("biases (Qwen3 export supports none)")
        return reasons
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


def _router_mismatches(moe: MoEConfig) -> List[str]:
    """What the top-k softmax routers of Qwen3-MoE / OLMoE cannot do."""
    reasons = []
    if moe.shared_expert_intermediate_size:
        reasons.append("a shared expert")
    if moe.router_enable_expert_bias:
        reasons.append("router expert bias (mlp.router.expert_bias has no place there)")
    for name, native in (("router_type", "token_choice"), ("router_score_function", "softmax")):
        if getattr(moe, name) != native:
            reasons.append(f"{name}={getattr(moe, name)}")
    for name in ("router_topk_scaling_factor", "expert_capacity_factor"):
        if getattr(moe, name) is not None:
            reasons.append(f"{name}={getattr(moe, name)}")
    return reasons


def _moe_mismatches(kind: str, config: TransformerConfig) -> List[str]:
    if config.moe is None:
        return [f"no MoE layers ({kind} is a mixture of experts; the dense classes are llama, qwen2, qwen3)"]
    reasons = _router_mismatches(config.moe)
    if config.add_bias_linear or config.add_qkv_bias:
        reasons.append(f"biases ({kind} export supports none)")
    wanted = "head" if kind == "qwen3_moe" else "all"
    if not config.qk_layernorm or config.qk_layernorm_scope != wanted:
        found = f"qk_layernorm_scope={config.qk_layernorm_scope}" if config.qk_layernorm else "no QK-norm"
        reasons.append(f"{kind} has QK-norm with qk_layernorm_scope={wanted}, the checkpoint {found}")
    if kind == "olmoe":
        if not all(config.moe.layer_flags):
            reasons.append("dense layers (OLMoE has experts in every layer)")
        if config.kv_channels * config.num_attention_heads != config.hidden_size:
            reasons.append("head_dim != hidden_size / num_attention_heads")
    return reasons


def native_mismatches(kind: str, config: TransformerConfig, dlm: DLMConfig) -> List[str]:
    """Why `kind` (llama, qwen2, qwen3, qwen3_moe, olmoe) cannot represent this checkpoint; empty when it can."""
    reasons = _common_mismatches(config, dlm)
    if dlm.effective_mask_type == "sliding_window" and kind not in hf_rope.WINDOW_KINDS:
        reasons.append(f"sliding-window attention ({kind} has none; {', '.join(hf_rope.WINDOW_KINDS)} have)")
    return reasons + (_moe_mismatches(kind, config) if kind in MOE_KINDS else _dense_mismatches(kind, config))


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
    for kind in ("qwen3", "llama", "qwen2", *MOE_KINDS):
        if not native_mismatches(kind, config, dlm):
            return kind
    return "dlm"


def _moe_fields(kind: str, config: TransformerConfig) -> dict:
    """The MoE fields of Qwen3-MoE, OLMoE or the DLM config (empty for a dense checkpoint)."""
    moe = config.moe
    if moe is None:
        return {}
    expert_ffn = moe.expert_ffn_size(config.ffn_hidden_size)
    fields = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.router_topk,
              "norm_topk_prob": not moe.router_pre_softmax, "router_aux_loss_coef": moe.aux_loss_coeff,
              "output_router_logits": False}
    if kind == "olmoe":
        return {**fields, "intermediate_size": expert_ffn}  # OLMoE's experts read intermediate_size
    fields["moe_intermediate_size"] = expert_ffn
    if kind == "qwen3_moe":
        return {**fields, "decoder_sparse_step": 1,
                "mlp_only_layers": [index for index, flag in enumerate(moe.layer_flags) if not flag]}
    return {**fields, "moe_layer_flags": list(moe.layer_flags),
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "router_type": moe.router_type, "router_score_function": moe.router_score_function,
            "router_pre_softmax": moe.router_pre_softmax, "router_topk_scaling_factor": moe.router_topk_scaling_factor,
            "expert_capacity_factor": moe.expert_capacity_factor, "router_expert_bias": moe.router_enable_expert_bias}


def _dlm_fields(config: TransformerConfig, dlm: DLMConfig, special_ids: Dict[str, Optional[int]]) -> dict:
    return {"model_type": "megadlm", "gated_mlp": config.gated_linear_unit,
            "normalization": config.normalization, "qk_norm": config.qk_layernorm,
            "qk_norm_scope": config.qk_layernorm_scope,
            "qkv_bias": config.add_bias_linear or config.add_qkv_bias,
            "o_proj_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
            "rotary_percent": config.rotary_percent, "model_running_mode": dlm.model_running_mode,
            "attention_mask_type": dlm.effective_mask_type,
            "attention_block_size": (dlm.block_size if dlm.effective_mask_type in ("block_causal", "block_diffusion")
                                     else None),
            "sliding_window": config.sliding_window if dlm.effective_mask_type in WINDOW_MASK_TYPES else None,
            "mask_token_id": dlm.mask_token_id if dlm.is_diffusion else special_ids.get("mask_token_id"),
            "ar_loss_weight": dlm.ar_loss_weight if dlm.causal_clean_half else 0.0,
            "auto_map": {"AutoConfig": "configuration_dlm.DLMConfig",
                         "AutoModel": "modeling_dlm.DLMModel",
                         "AutoModelForCausalLM": "modeling_dlm.DLMForCausalLM"}}


def _specific_fields(kind: str, config: TransformerConfig, window: Optional[int]) -> dict:
    """The fields of one native class (`window`: the sliding window of every layer, or None)."""
    if kind == "llama":
        return {"model_type": "llama", "attention_bias": config.add_bias_linear,
                "mlp_bias": config.add_bias_linear, "pretraining_tp": 1}
    if kind == "olmoe":
        return {"model_type": "olmoe", "attention_bias": False, "clip_qkv": None}
    specific = {"model_type": kind, **hf_rope.export_window(kind, config.num_layers, window)}
    if kind in ("qwen3", "qwen3_moe"):
        specific["attention_bias"] = False
    return specific


def export_config(kind: str, config: TransformerConfig, dlm: DLMConfig, special_ids: Dict[str, Optional[int]],
                  dtype: torch.dtype, provenance: dict) -> dict:
    """config.json of an export of `kind`."""
    vocab = config.unpadded_vocab_size or config.vocab_size
    common = {"vocab_size": vocab, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
              "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
              "hidden_act": config.activation, "max_position_embeddings": config.max_position_embeddings,
              "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
              "tie_word_embeddings": config.share_embeddings_and_output_weights, **hf_rope.export_rope(kind, config),
              "attention_dropout": 0.0, "use_cache": kind != "dlm",
              "bos_token_id": special_ids.get("bos_token_id"), "eos_token_id": special_ids.get("eos_token_id"),
              "pad_token_id": special_ids.get("pad_token_id"),
              "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", "")}
    window = config.sliding_window if dlm.effective_mask_type == "sliding_window" else None
    specific = _dlm_fields(config, dlm, special_ids) if kind == "dlm" else _specific_fields(kind, config, window)
    architecture = DLM_ARCHITECTURE if kind == "dlm" else NATIVE_ARCHITECTURES[kind]
    return {"architectures": [architecture], **common, **specific, **_moe_fields(kind, config),
            "megadlms": provenance}


# ---------------------------------------------------------------------- import
def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_IMPORTS:
        found = architectures or [hf.get("model_type", "unknown")]
        raise UnsupportedArchitecture(f"unsupported architecture {', '.join(map(str, found))}; supported: "
                                      f"{supported_imports_text()}")
    return architectures[0]


_QK_NORM_SCOPES = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "all"}
# transformers' class defaults, for keys a config.json leaves out.
_MOE_DEFAULTS = {"Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                         "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
                 "OlmoeForCausalLM": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
                                      "router_aux_loss_coef": 0.01}}


def _bias_fields(architecture: str, biases: Dict[str, bool]) -> dict:
    qkv, o_proj, mlp = biases["qkv"], biases["o_proj"], biases["mlp"]
    if (o_proj != qkv or mlp != qkv) and not (qkv and not o_proj and not mlp):  # QKV-only: Qwen2's add_qkv_bias
        raise UnsupportedArchitecture(f"{architecture} with biases on qkv={qkv}, o_proj={o_proj}, mlp={mlp} is "
                                      "not supported; supported: no biases, QKV-only, or all linear layers")
    return {"add_bias_linear": qkv and o_proj and mlp, "add_qkv_bias": qkv and not (o_proj and mlp)}


def _num_experts(hf: dict, architecture: str) -> int:
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute map), 4.x as num_experts."""
    return hf.get("num_experts", hf.get("num_local_experts", _MOE_DEFAULTS[architecture]["num_experts"]))


def _qwen3_moe_flags(hf: dict) -> List[int]:
    """Qwen3-MoE's rule, layer by layer: experts where (i + 1) % decoder_sparse_step == 0, unless i is in
    mlp_only_layers."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise UnsupportedArchitecture(f"decoder_sparse_step={step!r} must be a positive integer; fix config.json")
    experts = _num_experts(hf, "Qwen3MoeForCausalLM")
    return [int(experts > 0 and index not in dense and (index + 1) % step == 0)
            for index in range(hf["num_hidden_layers"])]


def _dlm_moe(hf: dict) -> Optional[MoEConfig]:
    """A DLM export's MoE: the full training config from its provenance, the routing from config.json."""
    saved = dict((hf.get("megadlms") or {}).get("moe_config") or {})
    if not hf.get("num_experts"):
        return None
    flags = hf.get("moe_layer_flags") or [1] * hf["num_hidden_layers"]
    explicit = {"num_experts": hf["num_experts"], "router_topk": hf["num_experts_per_tok"],
                "ffn_hidden_size": hf["moe_intermediate_size"],
                "layer_freq": saved.get("layer_freq", flags) if saved.get("layer_flags") == flags else flags,
                "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size"),
                "router_pre_softmax": bool(hf.get("router_pre_softmax", not hf.get("norm_topk_prob", True))),
                "router_enable_expert_bias": bool(hf.get("router_expert_bias")),
                "aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)}
    for name in ("router_type", "router_score_function", "router_topk_scaling_factor", "expert_capacity_factor"):
        if name in hf:
            explicit[name] = hf[name]
    saved.pop("layer_flags", None)
    return MoEConfig(**dataclass_fields(MoEConfig, {**saved, **explicit}))


def import_moe(architecture: str, hf: dict) -> Optional[MoEConfig]:
    """The MoEConfig of a Qwen3-MoE / OLMoE / MoE DLM config.json (None: every layer is dense)."""
    if architecture == DLM_ARCHITECTURE:
        return _dlm_moe(hf)
    if architecture not in _MOE_DEFAULTS:
        return None
    olmoe = architecture == "OlmoeForCausalLM"
    if olmoe and hf.get("clip_qkv") is not None:
        raise UnsupportedArchitecture(f"OlmoeForCausalLM with clip_qkv={hf['clip_qkv']} is not supported (MegaDLMs "
                                      "does not clip q/k/v); supported: clip_qkv null")
    flags = [1] * hf["num_hidden_layers"] if olmoe else _qwen3_moe_flags(hf)
    if not any(flags):
        return None

    def get(key):
        return hf.get(key, _MOE_DEFAULTS[architecture].get(key))

    return MoEConfig(num_experts=_num_experts(hf, architecture), router_topk=get("num_experts_per_tok"),
                     ffn_hidden_size=hf["intermediate_size"] if olmoe else get("moe_intermediate_size"),
                     router_pre_softmax=not get("norm_topk_prob"), layer_freq=flags,
                     aux_loss_coeff=float(get("router_aux_loss_coef") or 0.0))


def _dlm_import(hf: dict, fields: dict) -> dict:
    """A DLM export's objective (DLMConfig fields); sets its sliding window in `fields`."""
    mode = hf.get("model_running_mode", "difflm-noshift")
    mask_type = hf.get("attention_mask_type", "causal" if mode == "vanilla" else "no_mask")
    fields["sliding_window"] = hf.get("sliding_window") if mask_type in WINDOW_MASK_TYPES else None
    if mode == "vanilla" and mask_type != "sliding_window":  # vanilla attends causally (or in a window)
        mask_type = "no_mask"
    dlm_fields = {"model_running_mode": mode, "attention_mask_type": mask_type,
                  "mask_token_id": hf.get("mask_token_id"), "block_size": hf.get("attention_block_size")}
    if mask_type == "block_diffusion":  # its own mask over [x_t ; x_0]; the flag carries it
        dlm_fields.update(attention_mask_type="no_mask", block_diffusion=True,
                          ar_loss_weight=float(hf.get("ar_loss_weight") or 0.0))
    dlm_fields.update((hf.get("megadlms") or {}).get("dlm_config") or {})
    return dlm_fields


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
    window = None if is_dlm else hf_rope.import_window(hf, architecture)
    theta, fraction, rope_scaling = hf_rope.import_rope(hf, is_dlm)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    if architecture == "OlmoeForCausalLM" and head_dim * heads != hidden:
        raise UnsupportedArchitecture(f"OlmoeForCausalLM with head_dim={head_dim} is not supported (its q_norm is "
                                      f"hidden_size={hidden} wide); supported: head_dim = hidden_size / heads")
    tied = bool(hf.get("tie_word_embeddings", not has_lm_head))
    if tied and has_lm_head:
        tied = False  # a separate lm_head tensor wins over the flag: keep it
    qk_layernorm = architecture in _QK_NORM_SCOPES or bool(hf.get("qk_norm"))
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hidden,
                  ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
                  num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=head_dim,
                  vocab_size=hf["vocab_size"], unpadded_vocab_size=hf["vocab_size"],
                  max_position_embeddings=hf.get("max_position_embeddings", 4096),
                  normalization=hf.get("normalization", "RMSNorm"),
                  layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), qk_layernorm=qk_layernorm,
                  qk_layernorm_scope=_QK_NORM_SCOPES.get(architecture, hf.get("qk_norm_scope") or "head"),
                  **_bias_fields(architecture, biases),
                  gated_linear_unit=bool(hf.get("gated_mlp", True)), activation=act,
                  rotary_base=theta, rotary_percent=fraction, **rope_scaling, sliding_window=window,
                  moe=import_moe(architecture, hf),
                  init_method_std=hf.get("initializer_range", 0.02), share_embeddings_and_output_weights=tied)
    dlm_fields = _dlm_import(hf, fields) if is_dlm else {"model_running_mode": "vanilla"}
    if window is not None:  # an AR model's causal window
        dlm_fields["attention_mask_type"] = "sliding_window"
    return architecture, fields, dlm_fields


def dataclass_fields(cls, values: dict) -> dict:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in values.items() if key in names}
