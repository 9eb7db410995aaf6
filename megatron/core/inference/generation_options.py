"""Generation options: LLaDA's names, MegaDLMs' aliases, and their validation.

Like generation.py (which re-exports everything here), this file imports only the standard library
and torch: the Hugging Face exporter copies both next to an exported ``modeling_dlm.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["GenerationOptions", "resolve_options", "RUNNING_MODES", "MASK_TYPES", "ALIASES"]

# Copies of transformer_config.py's lists: this file ships inside Hugging Face exports and imports
# torch only (tests/unit_tests/test_copies_agree.py keeps the copies equal).
RUNNING_MODES = ("difflm-noshift", "difflm-shift", "vanilla")
MASK_TYPES = ("no_mask", "causal", "block_causal", "sliding_window", "sliding_window_two_sided")
# Block diffusion (BD3-LM) checkpoints: the sampler goes block by block over clean blocks.
SAMPLER_MASK_TYPES = MASK_TYPES + ("block_diffusion",)
REMASKING = ("low_confidence", "random")
CACHE_MODES = (None, "prefix", "dual")

# MegaDLMs' generation-config names -> LLaDA's names (the canonical ones here).
ALIASES = {"max_new_tokens": "gen_length", "sample_steps": "steps", "inference_block_size": "block_length",
           "cfg": "cfg_scale"}
_DLM_ONLY = ("steps", "block_length", "remasking", "cfg_scale", "threshold", "cache")
_AR_ONLY = ("use_cache",)


@dataclass
class GenerationOptions:
    """Resolved generation options (LLaDA's names; MegaDLMs' names are aliases)."""

    gen_length: int = 128
    """Tokens to generate (alias ``max_new_tokens``)."""
    steps: Optional[int] = None
    """DLM: denoising steps over all blocks, a multiple of the number of blocks; None means
    gen_length, one token per step (alias ``sample_steps``)."""
    block_length: Optional[int] = None
    """DLM: semi-autoregressive block length dividing gen_length; None means gen_length, pure
    diffusion (alias ``inference_block_size``)."""
    temperature: float = 0.0
    """0 is greedy; otherwise a draw from softmax(logits / temperature) (float64 inverse CDF)."""
    top_k: Optional[int] = None
    """Keep only the k most likely tokens before sampling (and for confidences)."""
    top_p: Optional[float] = None
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus)."""
    remasking: str = "low_confidence"
    """DLM: which predictions to commit: low_confidence (most probable first) or random."""
    cfg_scale: float = 0.0
    """DLM: classifier-free guidance w; logits = un + (w + 1)(cond - un) (alias ``cfg``)."""
    threshold: Optional[float] = None
    """DLM: commit every masked token of the block with confidence above it (at least one)."""
    cache: Optional[str] = None
    """DLM: block KV cache, None, "prefix" or "dual" (Fast-dLLM; approximate unless the
    attention keeps finished blocks from seeing later ones)."""
    use_cache: bool = True
    """AR: decode with a KV cache (prefill, then one token per step)."""
    attention_mask_type: Optional[str] = None
    """The attention the model was trained with: no_mask, causal, block_causal, sliding_window
    or block_diffusion (BD3-LM); None means no_mask for DLMs and causal for AR."""
    attention_block_size: Optional[int] = None
    """Block size of block_causal attention or block diffusion (not the sampler's block_length)."""
    causal_clean: bool = False
    """block_diffusion only: the clean (committed) blocks are token-causal, as the joint AR + DLM
    objective trains them (DLMConfig.causal_clean_half); the block being denoised stays bidirectional."""
    sliding_window: Optional[int] = None
    """Window of sliding_window attention."""
    generator: Optional[torch.Generator] = None
    """Random source of the sampling draws and random remasking, for reproducible samples."""
    entropy: Optional[torch.Tensor] = None
    """A float [B, gen_length] tensor the sampler fills (an output): at each generated slot the entropy in
    nats of the model's distribution (softmax of the logits, before temperature and filters) it was
    committed from; RL logs it as the policy's entropy."""
    seeds: Optional[Tuple[int, ...]] = None
    """Instead of `generator`, one integer a row: row b's draws are a function of seeds[b] and of the
    draw's place in the row's generation (block, step) alone, so a row samples the same completion
    whichever rows share its batch (data-parallel RL rollouts equal one process's)."""


def _label(name: str) -> str:
    aliases = [alias for alias, canonical in ALIASES.items() if canonical == name]
    return f"{name} ({aliases[0]})" if aliases else name


def _canonical_options(running_mode: str, options: dict) -> dict:
    """Map aliases to LLaDA's names, rejecting unknown names, conflicts and wrong-mode options."""
    known = {field.name for field in dataclasses.fields(GenerationOptions)}
    values: dict = {}
    for name, value in options.items():
        canonical = ALIASES.get(name, name)
        if canonical not in known:
            raise ValueError(f"unknown generation option {name!r}; known options: "
                             f"{', '.join(sorted(known | set(ALIASES)))}")
        if canonical in values and values[canonical] != value:
            raise ValueError(f"generation option {_label(canonical)} is given twice with different values "
                             f"({values[canonical]!r} and {value!r}); pass only one spelling")
        values[canonical] = value
    wrong = _DLM_ONLY if running_mode == "vanilla" else _AR_ONLY
    for name in wrong:
        if name in values:
            kind = "diffusion (difflm-*)" if running_mode == "vanilla" else "autoregressive (vanilla)"
            raise ValueError(f"generation option {_label(name)} applies to {kind} running modes only, "
                             f"not {running_mode!r}; drop it")
    return values


def resolve_options(running_mode: str, **options) -> GenerationOptions:
    """Validated `GenerationOptions`; one ValueError naming the option and the fix."""
    if running_mode not in RUNNING_MODES:
        raise ValueError(f"running_mode={running_mode!r} is not one of {RUNNING_MODES}")
    opts = GenerationOptions(**_canonical_options(running_mode, options))
    _check_int("gen_length (max_new_tokens)", opts.gen_length)
    if opts.attention_mask_type == "block_diffusion" and opts.block_length not in (None, opts.attention_block_size):
        raise ValueError(f"block_length (inference_block_size)={opts.block_length} differs from the block size "
                         f"{opts.attention_block_size} the block-diffusion model was trained with; drop it (the "
                         "sampler goes by the model's blocks)")
    if opts.attention_mask_type == "block_diffusion":  # blocks come from the model; gen_length is free
        opts = dataclasses.replace(opts, block_length=opts.gen_length)
    if running_mode != "vanilla":
        opts = _resolve_dlm(opts)
    if opts.temperature is None or opts.temperature < 0:
        raise ValueError(f"temperature={opts.temperature!r} must be >= 0 (0 is greedy)")
    if opts.top_k is not None:
        _check_int("top_k", opts.top_k)
    if opts.top_p is not None and not 0.0 < opts.top_p <= 1.0:
        raise ValueError(f"top_p={opts.top_p!r} must be in (0, 1]; use 1.0 or None to disable it")
    default_type = "causal" if running_mode == "vanilla" else "no_mask"
    opts = dataclasses.replace(opts, attention_mask_type=opts.attention_mask_type or default_type)
    _check_attention(running_mode, opts)
    if opts.generator is not None and not isinstance(opts.generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(opts.generator).__name__}")
    return _resolve_seeds(opts)


def _resolve_seeds(opts: GenerationOptions) -> GenerationOptions:
    if opts.seeds is None:
        return opts
    if opts.generator is not None:
        raise ValueError("give either generator (one stream for the batch) or seeds (one a row), not both")
    seeds = [int(seed) for seed in opts.seeds]
    if any(seed < 0 for seed in seeds):
        raise ValueError(f"seeds must be non-negative integers, got {min(seeds)}")
    return dataclasses.replace(opts, seeds=tuple(seeds))


def _check_int(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label}={value!r} must be a positive integer")


def _resolve_dlm(opts: GenerationOptions) -> GenerationOptions:
    block_length = opts.block_length if opts.block_length is not None else opts.gen_length
    steps = opts.steps if opts.steps is not None else opts.gen_length
    _check_int("block_length (inference_block_size)", block_length)
    _check_int("steps (sample_steps)", steps)
    if opts.gen_length % block_length:
        raise ValueError(f"gen_length (max_new_tokens)={opts.gen_length} is not a multiple of block_length "
                         f"(inference_block_size)={block_length}; choose a block length that divides it")
    blocks = opts.gen_length // block_length
    if opts.threshold is None and steps % blocks:
        raise ValueError(f"steps (sample_steps)={steps} is not divisible by the {blocks} blocks "
                         f"(gen_length / block_length); use a multiple of {blocks}")
    if opts.remasking not in REMASKING:
        raise ValueError(f"remasking={opts.remasking!r} is not one of {REMASKING}")
    if opts.cfg_scale is None or opts.cfg_scale < 0:
        raise ValueError(f"cfg_scale (cfg)={opts.cfg_scale!r} must be >= 0 (0 disables guidance)")
    if opts.cache not in CACHE_MODES:
        raise ValueError(f"cache={opts.cache!r} is not one of {CACHE_MODES}")
    if opts.threshold is not None:
        if not 0.0 <= opts.threshold <= 1.0:
            raise ValueError(f"threshold={opts.threshold!r} must be in [0, 1] (a token probability)")
        if opts.remasking != "low_confidence":
            raise ValueError("threshold decoding compares model confidences; use remasking='low_confidence'")
    return dataclasses.replace(opts, block_length=block_length, steps=steps)


def _check_attention(running_mode: str, opts: GenerationOptions) -> None:
    mask_type = opts.attention_mask_type
    if mask_type not in SAMPLER_MASK_TYPES:
        raise ValueError(f"attention_mask_type={mask_type!r} is not one of {SAMPLER_MASK_TYPES}")
    if running_mode == "vanilla" and mask_type not in ("causal", "sliding_window"):
        raise ValueError(f"attention_mask_type={mask_type!r} cannot decode autoregressively; "
                         "vanilla models use 'causal' (or 'sliding_window')")
    if mask_type in ("block_causal", "block_diffusion"):
        _check_int(f"attention_block_size (needed by attention_mask_type={mask_type!r})", opts.attention_block_size)
    if opts.causal_clean and mask_type != "block_diffusion":
        raise ValueError(f"causal_clean applies to block_diffusion attention only, not {mask_type!r}")
    if mask_type == "block_diffusion" and running_mode != "difflm-noshift":
        raise ValueError(f"a block-diffusion model samples in difflm-noshift mode, not {running_mode!r}")
    if mask_type in ("sliding_window", "sliding_window_two_sided"):
        _check_int(f"sliding_window (needed by attention_mask_type={mask_type!r})", opts.sliding_window)


def autoregressive_decoding(running_mode: str, pattern: dict) -> tuple:
    """(running mode, attention pattern) to decode token by token: a vanilla model's own, or a joint AR +
    DLM model's (block diffusion with causal clean blocks, `causal_clean`: its clean half is an AR model)."""
    if running_mode == "vanilla":
        return running_mode, pattern
    if not pattern.get("causal_clean"):
        raise ValueError("autoregressive=True decodes a vanilla model or a joint AR + DLM one (trained with "
                         "--difflm-ar-loss-weight); this model learned no next-token prediction")
    return "vanilla", dict(attention_mask_type="causal")
