"""RoPE inverse frequencies, plain or context-extended (Llama 3.1's scaling, YaRN). Torch only.

This file is the one home of the formulas: megatron/core/transformer/rope.py builds the training
tables from it, and the remote-code Hugging Face export carries a copy next to modeling_dlm.py
(tools/weights_conversion/megatron_to_hf.py), so an export rotates exactly as training did.
Everything is computed in float64. The settings are passed as a dict keyed by the
TransformerConfig field names listed in SCALING_DEFAULTS (the exported config.json uses the same
names), so the copy needs nothing from the framework.

- llama3 (Llama 3.1 paper, section 3.3 / Meta's reference code): a frequency whose wavelength is
  longer than original / low_freq_factor is divided by `factor`; one shorter than
  original / high_freq_factor is kept; in between, the two are mixed with weight
  (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) on the kept one.
- yarn (Peng et al. 2023, "YaRN", section 3.2-3.4): "NTK-by-parts" interpolation: dimension pairs
  that turn more than beta_fast times over the original context keep their frequency, those that
  turn fewer than beta_slow times are divided by `factor`, with a linear ramp between (over the pair
  index, its ends optionally rounded outwards to integers); plus the attention temperature
  sqrt(1/t) = 0.1 ln(s) + 1, applied by scaling cos and sin (so q.k scales by its square). With
  mscale / mscale_all_dim (DeepSeek's generalisation, Megatron's flags) the factor is
  (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1); the defaults 1 and 0 give the paper's.
"""

import math

import torch

SCALING_TYPES = ("none", "llama3", "yarn")
# The settings and their defaults (Megatron's: --rope-scaling-factor 8 with Llama 3.1's 1 / 4 / 8192;
# YaRN's --rotary-scaling-factor 1, 4096 original positions, betas 32 / 1, mscale 1 / 0, rounding on).
SCALING_DEFAULTS = {
    "rope_scaling_type": "none",
    "rope_scaling_factor": 8.0,
    "rope_scaling_low_freq_factor": 1.0,
    "rope_scaling_high_freq_factor": 4.0,
    "rope_scaling_original_max_position_embeddings": 8192,
    "yarn_rotary_scaling_factor": 1.0,
    "yarn_original_max_position_embeddings": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}
# The settings each type reads (the type itself included): what a checkpoint must agree on.
FIELDS_OF_TYPE = {"none": ("rope_scaling_type",),
                  "llama3": ("rope_scaling_type",) + tuple(k for k in SCALING_DEFAULTS if k.startswith("rope_scaling_")
                                                           and k != "rope_scaling_type"),
                  "yarn": ("rope_scaling_type",) + tuple(k for k in SCALING_DEFAULTS if k.startswith("yarn_"))}


def base_inv_freq(rotary_dim, base, device=None):
    """theta_i = base^(-2i / rotary_dim) for the rotary_dim / 2 dimension pairs."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return 1.0 / (float(base) ** exponents)


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1's adjustment of `inv_freq`, written as one clamp of its interpolation weight."""
    turns = original_max_position_embeddings * inv_freq / (2 * math.pi)  # rotations over the original context
    kept = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return kept * inv_freq + (1.0 - kept) * inv_freq / factor


def yarn_correction_range(rotary_dim, base, original_max_position_embeddings, beta_fast, beta_slow, round_to_int):
    """The pair indices where YaRN's ramp starts (beta_fast turns) and ends (beta_slow turns)."""
    def pair_for(turns):  # the (fractional) pair index whose wavelength fits `turns` times in the context
        return rotary_dim * math.log(original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_for(beta_fast), pair_for(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def yarn_inv_freq(rotary_dim, base, factor, original_max_position_embeddings, beta_fast, beta_slow, round_to_int,
                  device=None):
    low, high = yarn_correction_range(rotary_dim, base, original_max_position_embeddings, beta_fast, beta_slow,
                                      round_to_int)
    if low == high:
        high += 0.001  # a ramp of one step (the reference implementations' guard)
    pairs = torch.arange(rotary_dim // 2, dtype=torch.float64, device=device)
    interpolated = ((pairs - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = base_inv_freq(rotary_dim, base, device)
    return (1.0 - interpolated) * inv_freq + interpolated * inv_freq / factor


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor, mscale, mscale_all_dim):
    """What cos and sin are multiplied by."""
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def inverse_frequencies(rotary_dim, base, scaling, device=None):
    """(inv_freq [rotary_dim / 2] float64, attention factor) for the settings `scaling` (a dict of
    SCALING_DEFAULTS' keys; missing keys take the defaults)."""
    s = {**SCALING_DEFAULTS, **{k: v for k, v in (scaling or {}).items() if v is not None}}
    kind = s["rope_scaling_type"]
    if kind == "llama3":
        inv_freq = llama3_inv_freq(base_inv_freq(rotary_dim, base, device), s["rope_scaling_factor"],
                                   s["rope_scaling_low_freq_factor"], s["rope_scaling_high_freq_factor"],
                                   s["rope_scaling_original_max_position_embeddings"])
        return inv_freq, 1.0
    if kind == "yarn":
        factor = s["yarn_rotary_scaling_factor"]
        inv_freq = yarn_inv_freq(rotary_dim, base, factor, s["yarn_original_max_position_embeddings"],
                                 s["yarn_beta_fast"], s["yarn_beta_slow"], s["yarn_correction_range_round_to_int"],
                                 device)
        return inv_freq, yarn_attention_factor(factor, s["yarn_mscale"], s["yarn_mscale_all_dim"])
    if kind != "none":
        raise ValueError(f"rope_scaling_type={kind!r} is not one of {SCALING_TYPES}")
    return base_inv_freq(rotary_dim, base, device), 1.0
