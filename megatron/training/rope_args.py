"""RoPE context-extension flags (Megatron-LM's names) and the TransformerConfig fields they set.

- Llama 3.x scaling: `--use-rope-scaling` with `--rope-scaling-factor` (default 8). Megatron-LM
  hard-codes the other three Llama 3.1 constants (low / high frequency factors 1 / 4, original
  context 8192); the `--rope-scaling-low-freq-factor`, `--rope-scaling-high-freq-factor` and
  `--rope-scaling-original-max-position-embeddings` flags (MegaDLMs') keep those defaults and let
  a checkpoint imported from another Llama-3-style config be trained with its own values.
- YaRN: `--position-embedding-type yarn` with `--rotary-scaling-factor`,
  `--yarn-original-max-position-embeddings`, `--yarn-beta-fast`, `--yarn-beta-slow`, `--mscale`,
  `--mscale-all-dim`, `--[no-]yarn-correction-range-round-to-int`, unset ones taking Megatron's
  defaults (1, 4096, 32, 1, 1, 0, rounding on).
- `--rope-type`: Megatron's switch for multi-latent attention; standard attention accepts only
  `rope` (as Megatron asserts), so `--rope-type rope` is accepted and `yarn` refused.
The formulas are in megatron/core/transformer/rope_scaling.py.
"""

from __future__ import annotations

import argparse

from megatron.core.transformer.rope_scaling import SCALING_DEFAULTS

_LLAMA3 = ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
           "rope_scaling_original_max_position_embeddings")
# Flag dest -> TransformerConfig field, for the YaRN flags Megatron spells without the yarn_ prefix.
_YARN = {"rotary_scaling_factor": "yarn_rotary_scaling_factor",
         "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
         "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
         "mscale_all_dim": "yarn_mscale_all_dim",
         "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int"}
# For arguments.FLAG_NEEDS: each flag acts only with its scaling type.
ROPE_FLAG_NEEDS = tuple(
    [(dest, "--use-rope-scaling", lambda a: a.use_rope_scaling) for dest in _LLAMA3]
    + [(dest, "--position-embedding-type yarn", lambda a: a.position_embedding_type == "yarn") for dest in _YARN]
    + [("use_rope_scaling", "--position-embedding-type rope (YaRN is its own scaling)",
        lambda a: a.position_embedding_type == "rope")])
# For arguments.CONFIG_FIELD_FLAGS: the flag behind each field a config error names.
ROPE_FIELD_FLAGS = {"rope_scaling_type": "--use-rope-scaling / --position-embedding-type",
                    **{field: f"--{dest.replace('_', '-')}" for dest, field in _YARN.items()}}


def add_rope_args(group) -> None:
    """Into the model group of arguments.py (next to --position-embedding-type, --rotary-base)."""
    g = group
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE scaling of the low frequencies (Llama 3.1 paper, section 3.3).")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama 3.x: the scaling factor.")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="Llama 3.x: wavelengths above original context / this are scaled in full.")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="Llama 3.x: wavelengths below original context / this are kept.")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="Llama 3.x: the pretraining context length.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN (--position-embedding-type yarn): the context extension factor.")
    g.add_argument("--yarn-original-max-position-embeddings", type=int,
                   help="YaRN: the pretraining context length (default 4096).")
    g.add_argument("--yarn-beta-fast", type=float, help="YaRN: rotations above which a frequency is kept (32).")
    g.add_argument("--yarn-beta-slow", type=float, help="YaRN: rotations below which it is interpolated (1).")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: round the ramp's ends to whole dimension pairs (the default).")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int", default=None,
                   help="YaRN: keep the ramp's ends fractional.")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN: attention factor numerator coefficient.")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN: attention factor denominator coefficient (0: the paper's 0.1 ln s + 1).")
    g.add_argument("--rope-type", choices=["rope", "yarn"],
                   help="Megatron's multi-latent-attention switch; standard attention takes rope only.")


def validate_rope_args(args: argparse.Namespace) -> None:
    if args.rope_type == "yarn":
        raise ValueError("--rope-type yarn selects YaRN for multi-latent attention, which this release does not "
                         "have; standard attention takes --rope-type rope: use --position-embedding-type yarn")


def rope_config_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig position fields of the flags: the type (yarn is RoPE, scaled) and the RoPE-scaling
    fields (unset YaRN flags: Megatron's defaults)."""
    kind = "yarn" if args.position_embedding_type == "yarn" else "llama3" if args.use_rope_scaling else "none"
    learned = args.position_embedding_type == "learned_absolute"
    fields = {"position_embedding_type": "learned_absolute" if learned else "rope", "rope_scaling_type": kind,
              **{dest: getattr(args, dest) for dest in _LLAMA3}}
    for dest, field in _YARN.items():
        value = getattr(args, dest)
        fields[field] = SCALING_DEFAULTS[field] if value is None else value
    return fields


def checkpoint_rope_flags(args: argparse.Namespace, saved: dict) -> None:
    """--use-checkpoint-args: the scaling flags from a checkpoint's transformer_config."""
    kind = saved.get("rope_scaling_type", "none")
    args.use_rope_scaling = kind == "llama3"
    args.position_embedding_type = "yarn" if kind == "yarn" else "rope"
    if saved.get("position_embedding_type") == "learned_absolute":  # a learned table: no RoPE to scale
        args.position_embedding_type = "learned_absolute"
    for dest in _LLAMA3:
        if kind == "llama3" and dest in saved:
            setattr(args, dest, saved[dest])
    for dest, field in _YARN.items():
        if kind == "yarn" and field in saved:
            setattr(args, dest, saved[field])
