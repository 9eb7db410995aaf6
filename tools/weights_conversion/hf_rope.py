"""RoPE scaling and sliding-window attention: Hugging Face config.json <-> TransformerConfig fields.

RoPE: transformers 5 keeps the settings in `rope_parameters` ({"rope_type", "rope_theta", "factor",
...}); 4.x and older folders in `rope_scaling` (`type` or `rope_type`) next to a top-level
`rope_theta`, and 5.x still reads that legacy key first. Both spellings import; exports write both
(`rope_scaling` only when scaled), so either version computes the same frequencies. Supported:
`default`, `llama3` (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
and `yarn` (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, and the
attention factor: `attention_factor`, or `mscale` with `mscale_all_dim`, as transformers derives it).
Other types (linear, dynamic, longrope, ...) are refused with one line.

YaRN's attention factor: transformers uses `attention_factor` when given, else
(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1) when both mscales are nonzero, else
0.1 ln s + 1. Ours is always the ratio (Megatron's), which expresses each case: an explicit factor
f > 1 is mscale = (f - 1) / (0.1 ln s) with mscale_all_dim 0 (f < 1: the reciprocal in the
denominator). Exports write what makes transformers compute our factor.

Sliding window: our window is causal, key j visible from query i when 0 <= i - j < window, which
is transformers' rule (`kv_idx > q_idx - sliding_window` on top of the causal mask). Qwen2 / Qwen3
apply it in the layers `layer_types` marks "sliding_attention" (by default those from
`max_window_layers` on, when `use_sliding_window`); Qwen3-MoE in every layer. MegaDLMs applies one
pattern to all layers: a window in every layer or in none imports, a mix is refused.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from megatron.core.transformer.rope_scaling import FIELDS_OF_TYPE, yarn_attention_factor, yarn_mscale
from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
# Native exports whose class applies a sliding window (in every layer, as written here).
WINDOW_KINDS = ("qwen2", "qwen3", "qwen3_moe")
_WINDOW_LAYERS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # per-layer windows (layer_types / max_window_layers)
# transformers' class defaults when a key is absent.
_DEFAULT_WINDOW, _DEFAULT_WINDOW_LAYERS = 4096, 28


class UnsupportedArchitecture(ValueError):
    """An HF architecture or setting MegaDLMs cannot reproduce (hf_config's, defined here to avoid a cycle)."""


Unsupported = UnsupportedArchitecture


def _kind(source: dict) -> str:
    return source.get("rope_type", source.get("type")) or "default"


def _rope_source(hf: dict) -> dict:
    """The RoPE dict transformers would use: the legacy `rope_scaling` wins over `rope_parameters`."""
    parameters, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for source in (parameters, scaling):
        if any(isinstance(value, dict) for value in source.values()):
            raise Unsupported("RoPE parameters per layer type are not supported; supported: one set for all layers")
    theta = {"rope_theta": parameters["rope_theta"]} if "rope_theta" in parameters else {}
    return {**theta, **(scaling or parameters)}


def _original_context(source: dict, hf: dict) -> int:
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style), then the dict's,
    # then max_position_embeddings.
    return int(hf.get("original_max_position_embeddings") or source.get("original_max_position_embeddings")
               or hf.get("max_position_embeddings", 4096))


def _require(source: dict, names: Tuple[str, ...], kind: str) -> None:
    missing = [name for name in names if source.get(name) is None]
    if missing:
        raise Unsupported(f"rope_type {kind!r} without {', '.join(missing)}; transformers needs them too: fix "
                          "config.json")


def _llama3(source: dict, hf: dict) -> dict:
    _require(source, ("factor", "low_freq_factor", "high_freq_factor"), "llama3")
    return {"rope_scaling_type": "llama3", "rope_scaling_factor": float(source["factor"]),
            "rope_scaling_low_freq_factor": float(source["low_freq_factor"]),
            "rope_scaling_high_freq_factor": float(source["high_freq_factor"]),
            "rope_scaling_original_max_position_embeddings": _original_context(source, hf)}


def _yarn_mscales(factor: float, source: dict) -> Tuple[float, float]:
    """(mscale, mscale_all_dim) giving transformers' attention factor under our ratio."""
    explicit = source.get("attention_factor")
    mscale, all_dim = source.get("mscale"), source.get("mscale_all_dim")
    if explicit is None:
        return (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)
    explicit = float(explicit)
    if factor <= 1:
        if explicit != 1.0:
            raise Unsupported(f"yarn attention_factor={explicit} with factor={factor} <= 1 is not supported; "
                              "supported: attention_factor 1 (or none) when the factor is at most 1")
        return 1.0, 0.0
    step = 0.1 * math.log(factor)
    return ((explicit - 1.0) / step, 0.0) if explicit >= 1.0 else (0.0, (1.0 / explicit - 1.0) / step)


def _yarn(source: dict, hf: dict) -> dict:
    original = _original_context(source, hf)
    factor = source.get("factor")
    factor = float(factor) if factor is not None else hf.get("max_position_embeddings", 4096) / original
    mscale, all_dim = _yarn_mscales(factor, source)
    return {"rope_scaling_type": "yarn", "yarn_rotary_scaling_factor": factor,
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(source.get("beta_fast") or 32.0),  # transformers: `or` (0 means the default)
            "yarn_beta_slow": float(source.get("beta_slow") or 1.0),
            "yarn_mscale": mscale, "yarn_mscale_all_dim": all_dim,
            "yarn_correction_range_round_to_int": bool(source.get("truncate", True))}


def import_rope(hf: dict, is_dlm: bool) -> Tuple[float, float, dict]:
    """(rope base, rotary fraction, TransformerConfig RoPE-scaling fields) of a config.json."""
    source = _rope_source(hf)
    theta = source.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = source.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_percent", 1.0)))
    if is_dlm:  # our own export: the fields by name
        kind = hf.get("rope_scaling_type", "none")
        return float(theta), float(fraction), {name: hf[name] for name in FIELDS_OF_TYPE.get(kind, ()) if name in hf}
    kind = _kind(source)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise Unsupported(f"RoPE scaling {kind!r} is not supported; supported rope_type: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling = {"default": lambda s, h: {}, "llama3": _llama3, "yarn": _yarn}[kind](source, hf)
    return float(theta), float(fraction), scaling


def _yarn_export(config: TransformerConfig) -> dict:
    factor, mscale, all_dim = config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim
    fields = {"rope_type": "yarn", "factor": factor,
              "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
              "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow}
    if not config.yarn_correction_range_round_to_int:
        fields["truncate"] = False
    if mscale and all_dim:
        fields.update(mscale=mscale, mscale_all_dim=all_dim)
    elif yarn_attention_factor(factor, mscale, all_dim) != yarn_mscale(factor):
        fields["attention_factor"] = float(yarn_attention_factor(factor, mscale, all_dim))
    return fields


def _scaling_export(config: TransformerConfig) -> dict:
    """transformers' RoPE-scaling dict (rope_type and its parameters; empty when unscaled)."""
    if config.rope_scaling_type == "llama3":
        return {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                "low_freq_factor": config.rope_scaling_low_freq_factor,
                "high_freq_factor": config.rope_scaling_high_freq_factor,
                "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings}
    return _yarn_export(config) if config.rope_scaling_type == "yarn" else {}


def export_rope(kind: str, config: TransformerConfig) -> dict:
    """The RoPE keys of config.json for export `kind` (dlm: our field names, read by modeling_dlm.py)."""
    if kind == "dlm":
        names = FIELDS_OF_TYPE[config.rope_scaling_type] if config.rope_scaling_type != "none" else ()
        return {"rope_theta": config.rotary_base, **{name: getattr(config, name) for name in names}}
    scaling = _scaling_export(config)
    # transformers 4.x reads rope_theta (+ rope_scaling), 5.x rope_parameters (rope_scaling first): all agree.
    fields = {"rope_theta": config.rotary_base,
              "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base, **scaling}}
    if scaling:
        fields["rope_scaling"] = scaling
    return fields


# ---------------------------------------------------------------------- sliding window
def _layer_types(hf: dict, window: Optional[int]) -> List[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    start = hf.get("max_window_layers", _DEFAULT_WINDOW_LAYERS)
    return ["sliding_attention" if window is not None and index >= start else "full_attention"
            for index in range(hf["num_hidden_layers"])]


def import_window(hf: dict, architecture: str) -> Optional[int]:
    """The sliding window every layer applies (None: full causal attention)."""
    use = bool(hf.get("use_sliding_window"))
    window = hf.get("sliding_window", _DEFAULT_WINDOW) if use else None
    if architecture == "Qwen3MoeForCausalLM":
        return window
    if architecture not in _WINDOW_LAYERS:
        if use or (architecture == "LlamaForCausalLM" and hf.get("sliding_window")):
            raise Unsupported(f"{architecture} with sliding-window attention is not supported; supported: full "
                              f"attention (sliding windows: {', '.join(_WINDOW_LAYERS)}, Qwen3MoeForCausalLM)")
        return None
    types = _layer_types(hf, window)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise Unsupported(f"{architecture} layer_types {types} is not supported; supported: one "
                          "'full_attention' or 'sliding_attention' per layer")
    sliding = [index for index, name in enumerate(types) if name == "sliding_attention"]
    if not sliding:
        return None
    if window is None:
        raise Unsupported(f"{architecture} marks layers {sliding} sliding_attention but sets no window "
                          "(use_sliding_window is false); fix config.json")
    if len(sliding) != len(types):
        raise Unsupported(f"{architecture} with a sliding window in only some layers ({len(sliding)} of {len(types)}, "
                          "from max_window_layers / layer_types) is not supported: MegaDLMs applies one attention "
                          "pattern to every layer; supported: a window in every layer (max_window_layers 0) or none")
    return int(window)


def export_window(kind: str, num_layers: int, window: Optional[int]) -> dict:
    """The sliding-window keys of a Qwen2 / Qwen3 / Qwen3-MoE config.json (window None: full attention)."""
    layer = "sliding_attention" if window else "full_attention"
    return {"use_sliding_window": bool(window), "sliding_window": window,
            "max_window_layers": 0 if window else num_layers, "layer_types": [layer] * num_layers}
