"""Typed configuration of the transformer and of the diffusion objective.

Every field carries a docstring; `validate()` raises one `ValueError` per problem that
names the field and says how to fix it. Command-line flags (megatron/training) build these
dataclasses; nothing in megatron/core reads global arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.transformer.moe.config import MoEConfig
from megatron.core.transformer.rope_scaling import SCALING_TYPES

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("silu", "gelu", "relu")
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# sdpa: torch SDPA, cuDNN kernel first; sdpa_flash: SDPA with the flash kernel first (Megatron's
# --attention-backend flash); flex: FlexAttention; math: explicit fp32 scores (the reference).
ATTENTION_BACKENDS = ("auto", "sdpa", "sdpa_flash", "flex", "math")
QK_LAYERNORM_SCOPES = ("head", "all")
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")
ROPE_SCALING_TYPES = SCALING_TYPES

RUNNING_MODES = ("difflm-noshift", "difflm-shift", "vanilla")
ATTENTION_MASK_TYPES = ("no_mask", "causal", "block_causal", "sliding_window", "sliding_window_two_sided")
# Windows of --sliding-window keys: causal (0 <= i - j < w, AR and DLMs) or two-sided (|i - j| < w, DLMs).
WINDOW_MASK_TYPES = ("sliding_window", "sliding_window_two_sided")
# Megatron's spelling of the bottom-right causal mask, accepted as an alias of `causal`; the causal
# window under a name that says so.
MASK_TYPE_ALIASES = {"causal_bottom_right": "causal", "sliding_window_causal": "sliding_window"}
T_SAMPLINGS = ("uniform", "antithetic")
T_DISTRIBUTIONS = ("uniform", "logit_normal", "beta")
LOSS_WEIGHTS = ("inverse_p", "inverse_empirical", "none")
LOSS_NORMALIZERS = ("tokens", "masked", "sequence")
LOSS_KERNELS = ("triton", "inductor")


def _check_choice(owner: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of {list(choices)}; pick one of them")


def _check_positive(owner: str, name: str, value) -> None:
    if value is None or value <= 0:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer")


@dataclass
class TransformerConfig:
    """Shape, numerics and execution options of a decoder-only transformer.

    The parallel sizes are not fields: a layer's layout is the process groups it is built with
    (`ProcessGroups`), and the run's is `ParallelConfig` (run_config.py). What the layout needs of
    the shapes is checked where the sizes are known: on the flags (parallel_args.py, moe_args.py)
    and on the groups when a layer is built."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: Optional[int] = None
    """Number of key/value heads (GQA). None means equal to num_attention_heads (MHA)."""
    kv_channels: Optional[int] = None
    """Head dimension. None means hidden_size // num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    """Inner width of the MLP. None means 4 * hidden_size."""
    vocab_size: int = 256
    """Size of the embedding table and output layer (already padded)."""
    unpadded_vocab_size: Optional[int] = None
    """The tokenizer's vocabulary before padding; checkpoints store only these rows, so a
    checkpoint loads under any tensor-parallel size whatever padding that size needs."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary tables are built for; longer inputs are rejected."""

    normalization: str = "RMSNorm"
    """Normalisation layer: RMSNorm or LayerNorm."""
    layernorm_epsilon: float = 1e-6
    """Epsilon added to the variance in every normalisation layer."""
    layernorm_zero_centered_gamma: bool = False
    """Every norm stores its scale as w - 1 (initialised at 0) and multiplies by 1 + w (Megatron's
    --apply-layernorm-1p): weight decay, if any, then pulls the scale toward 1, not 0."""
    qk_layernorm: bool = False
    """Apply a normalisation over head_dim to queries and keys before RoPE (Qwen3, OLMo2)."""
    qk_layernorm_scope: str = "head"
    """What the QK-norm normalises: 'head' (each head's head_dim channels, one [head_dim] weight
    shared by the heads: Qwen3) or 'all' (the whole query / key projection, heads x head_dim wide,
    before the split into heads, with a weight of that width: OLMoE, OLMo2). Under tensor
    parallelism 'all' sums its statistics over the tp ranks, which hold different heads."""
    add_bias_linear: bool = False
    """Add biases to every linear layer."""
    add_qkv_bias: bool = False
    """Add a bias to the QKV projection only (Qwen2)."""
    gated_linear_unit: bool = True
    """Use a gated MLP (fc1 produces gate and up projections); with silu this is SwiGLU."""
    activation: str = "silu"
    """MLP activation: silu, gelu or relu."""

    position_embedding_type: str = "rope"
    """rope (rotary, applied to q and k; its scaling: rope_scaling_type) or learned_absolute (a learned
    [max_position_embeddings, hidden] table added to the word embeddings: Megatron-LM's GPT default)."""
    rotary_base: float = 10000.0
    """RoPE base (theta)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that rotate; the rest pass through."""
    rope_scaling_type: str = "none"
    """Context extension of the RoPE frequencies (rope_scaling.py): none, llama3 (Llama 3.1's
    scaling, Megatron's --use-rope-scaling) or yarn (--position-embedding-type yarn)."""
    rope_scaling_factor: float = 8.0
    """llama3: how much slower the low frequencies turn (Megatron's --rope-scaling-factor)."""
    rope_scaling_low_freq_factor: float = 1.0
    """llama3: wavelengths above original / low_freq_factor are divided by the factor in full."""
    rope_scaling_high_freq_factor: float = 4.0
    """llama3: wavelengths below original / high_freq_factor are kept; those between are mixed."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """llama3: the pretraining context the wavelengths are compared with (Llama 3.x: 8192)."""
    yarn_rotary_scaling_factor: float = 1.0
    """yarn: the context extension s (Megatron's --rotary-scaling-factor; HF `factor`)."""
    yarn_original_max_position_embeddings: int = 4096
    """yarn: the pretraining context the rotations are counted over."""
    yarn_beta_fast: float = 32.0
    """yarn: dimension pairs turning more often than this over the original context are kept."""
    yarn_beta_slow: float = 1.0
    """yarn: pairs turning fewer times than this are interpolated (divided by the factor) in full."""
    yarn_mscale: float = 1.0
    """yarn: cos and sin are scaled by (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)."""
    yarn_mscale_all_dim: float = 0.0
    """yarn: the denominator's coefficient of that attention factor (0: the YaRN paper's factor)."""
    yarn_correction_range_round_to_int: bool = True
    """yarn: round the ramp's ends outwards to whole pair indices (HF `truncate`)."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before the residual add."""
    init_method_std: float = 0.02
    """Std of the normal init of weights; output projections use std / sqrt(2 * num_layers)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding."""

    params_dtype: torch.dtype = torch.float32
    """Dtype the parameters are created in (master weights stay fp32 under bf16/fp16)."""
    bf16: bool = False
    """Compute in bfloat16 (autocast) with fp32 parameters."""
    fp16: bool = False
    """Compute in float16 (autocast) with fp32 parameters."""
    gradient_accumulation_fusion: bool = True
    """Under bf16/fp16, the linear layers' weight-gradient GEMMs write the fp32 gradient themselves
    (on CUDA; tensor_parallel/fp32_weight_grad.py) instead of the compute dtype and a cast."""
    bias_swiglu_fusion: bool = True
    """SwiGLU's forward and backward as Triton kernels on CUDA (fusions/fused_swiglu.py) instead of
    the tensor math; Megatron's flag name (there is no fc1 bias to fuse when biases are off)."""

    recompute_granularity: Optional[str] = None
    """None, 'selective' (recompute core attention only) or 'full' (whole layers)."""
    recompute_method: Optional[str] = None
    """For full recompute: 'uniform' (every recompute_num_layers-th group) or 'block' (first N layers)."""
    recompute_num_layers: Optional[int] = None
    """For full recompute: group size ('uniform') or number of recomputed layers ('block')."""

    attention_backend: str = "auto"
    """Core attention kernel: auto, sdpa, flex or math (reference)."""
    sliding_window: Optional[int] = None
    """Window length for the sliding_window mask type: key j is visible from query i when 0 <= i - j < window."""
    check_token_ids: bool = True
    """GPTModel checks that input, label and position ids lie in range before any heavy work and
    raises a ValueError naming the fix. For ids on an accelerator that reads their min and max back:
    one host sync per forward. False replaces it there by a device-side assert (no sync; a bad id
    then aborts the process with the assert's message). pretrain_difflm.py checks each batch on the
    host before copying it to the device and builds its model with False."""

    cp_comm_type: str = "all_gather"
    """How context parallelism attends over the whole sequence: 'all_gather' (keys and values
    gathered to every rank) or 'a2a' (Ulysses: all-to-all from sequence to head shards and back)."""
    moe: Optional[MoEConfig] = None
    """Mixture-of-experts layers in the MLP slot (None: every layer is dense)."""
    sequence_parallel: bool = False
    """Shard norm/dropout regions along the sequence across tensor-parallel ranks (acts only where
    the tensor-parallel group has more than one rank; --sequence-parallel, this run's one home of it)."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe is not None:
            self.moe.resolve(self.num_layers)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return self.params_dtype

    def validate(self) -> "TransformerConfig":
        owner = "TransformerConfig"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            _check_positive(owner, name, getattr(self, name))
        if self.unpadded_vocab_size is not None and not 0 < self.unpadded_vocab_size <= self.vocab_size:
            raise ValueError(f"{owner}.unpadded_vocab_size={self.unpadded_vocab_size} must be in (0, vocab_size="
                             f"{self.vocab_size}]")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{owner}.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}; choose a number of query groups that divides the heads")
        _check_choice(owner, "normalization", self.normalization, NORMALIZATIONS)
        _check_choice(owner, "activation", self.activation, ACTIVATIONS)
        _check_choice(owner, "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice(owner, "qk_layernorm_scope", self.qk_layernorm_scope, QK_LAYERNORM_SCOPES)
        if self.qk_layernorm_scope != "head" and not self.qk_layernorm:
            raise ValueError(f"{owner}.qk_layernorm_scope={self.qk_layernorm_scope!r} needs qk_layernorm; "
                             "add --qk-layernorm or drop the scope")
        # Chained comparisons, so NaN and inf fail them too.
        for name in ("layernorm_epsilon", "init_method_std", "rotary_base"):
            if not 0.0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number > 0")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"{owner}.rotary_percent={self.rotary_percent} must be in (0, 1]")
        rotary_dim = int(self.kv_channels * self.rotary_percent)
        if rotary_dim % 2:
            raise ValueError(
                f"{owner}.rotary_percent={self.rotary_percent} gives an odd rotary dimension {rotary_dim} "
                f"of kv_channels={self.kv_channels}; choose a percent that gives an even number")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be in [0, 1)")
        if self.bf16 and self.fp16:
            raise ValueError(f"{owner}: bf16 and fp16 are both set; choose one")
        self._validate_recompute()
        _check_choice(owner, "position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        if self.position_embedding_type == "learned_absolute" and self.rope_scaling_type != "none":
            raise ValueError(f"{owner}.rope_scaling_type={self.rope_scaling_type!r} scales RoPE, which a "
                             "learned_absolute model does not use; set it to 'none'")
        self._validate_rope_scaling()
        if self.sliding_window is not None:
            _check_positive(owner, "sliding_window", self.sliding_window)
        _check_choice(owner, "cp_comm_type", self.cp_comm_type, ("all_gather", "a2a"))
        if self.moe is not None:
            self.moe.validate(self.ffn_hidden_size)
        return self

    def _validate_rope_scaling(self) -> None:
        owner = "TransformerConfig"
        _check_choice(owner, "rope_scaling_type", self.rope_scaling_type, ROPE_SCALING_TYPES)
        if self.rope_scaling_type == "llama3":
            for name in ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor"):
                if not 0.0 < getattr(self, name) < float("inf"):
                    raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number > 0")
            if not self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
                raise ValueError(f"{owner}.rope_scaling_high_freq_factor={self.rope_scaling_high_freq_factor} must "
                                 f"exceed rope_scaling_low_freq_factor={self.rope_scaling_low_freq_factor}")
            _check_positive(owner, "rope_scaling_original_max_position_embeddings",
                            self.rope_scaling_original_max_position_embeddings)
        elif self.rope_scaling_type == "yarn":
            for name in ("yarn_rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow"):
                if not 0.0 < getattr(self, name) < float("inf"):
                    raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number > 0")
            for name in ("yarn_mscale", "yarn_mscale_all_dim"):
                if not 0.0 <= getattr(self, name) < float("inf"):
                    raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number >= 0")
            _check_positive(owner, "yarn_original_max_position_embeddings", self.yarn_original_max_position_embeddings)

    def _validate_recompute(self) -> None:
        owner = "TransformerConfig"
        if self.recompute_granularity is None:
            return
        _check_choice(owner, "recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        if self.recompute_granularity != "full":
            return
        _check_choice(owner, "recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        _check_positive(owner, "recompute_num_layers", self.recompute_num_layers)
        if self.recompute_num_layers > self.num_layers:
            raise ValueError(f"{owner}.recompute_num_layers={self.recompute_num_layers} exceeds "
                             f"num_layers={self.num_layers}")

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class DLMConfig:
    """The masked-diffusion objective (shared/DESIGN.md section 3)."""

    model_running_mode: str = "difflm-noshift"
    """difflm-noshift: position i predicts clean token i. difflm-shift: position i predicts
    token i+1 (AR-initialised DLMs, Dream-style). vanilla: autoregressive next-token loss."""
    attention_mask_type: str = "no_mask"
    """Attention pattern in the DLM modes: no_mask (bidirectional), causal (bottom-right),
    block_causal (bidirectional inside blocks of block_size, causal across blocks),
    sliding_window. The vanilla mode runs causal, or sliding_window (a causal window, as Qwen2 /
    Mistral; the only other type an autoregressive model can use)."""
    mask_token_id: Optional[int] = None
    """Token id written into corrupted positions. Required in the DLM modes."""
    block_size: Optional[int] = None
    """Block length for block_causal attention and block diffusion; must divide the sequence length.
    Under a block_size_schedule, the size of forwards outside training's steps (sampling, in-loop
    lm-eval): by default the schedule's first; a checkpoint records the size it ends at."""
    block_size_schedule: Optional[tuple] = None
    """A block-size curriculum (LLaDA 2.0, SDAR): ((first iteration, block size), ...), iterations
    increasing from 0 (--difflm-block-size-schedule 0:1,2000:4,...). Step k (0-based: the iterations
    completed before it) trains with the size of the last entry at or before k (`at_iteration`); a pure
    function of k, so every rank and stage agrees and a resumed run replays it. None: block_size always."""
    block_diffusion: bool = False
    """BD3-LM: the model reads [x_t ; x_0] (2L tokens, positions repeated) under the block_diffusion
    mask (attention_mask.block_diffusion_allowed), t is drawn per block, the loss is on x_t only.
    Sampling goes block by block with an exact KV cache of the clean blocks."""
    ar_loss_weight: float = 0.0
    """Joint AR + DLM objective (Megatron-Bridge's Nemotron Diffusion recipe): W > 0 adds W times the
    next-token loss of the clean tokens to the diffusion loss, in one forward. Needs block_diffusion:
    the clean half of [x_t ; x_0] is then token-causal (`causal_clean_half`), so its output at i is an
    AR model's prediction of token i + 1; the noisy blocks see the clean blocks before them as before.
    The AR sum shares the diffusion term's normalizer: tokens (per loss token) or sequence (each row's mean,
    then the mean over rows); masked is refused."""
    confidence_loss_weight: float = 0.0
    """LLaDA 2.0's confidence-aware (CAP) training: lambda > 0 adds lambda times the entropy of the
    predictive distribution at each masked position whose argmax is already the clean token (the
    correct ones only: sharper where right, so threshold decoding commits more tokens a step),
    summed and divided by the diffusion term's normalizer. Not an ELBO term. Full-logits loss only."""
    ignore_bos: bool = False
    """Never mask the first token of a row (BD3-LM's ignore_bos): it is always clean and has no loss."""
    eps: float = 1e-3
    """Lowest mask probability: p = (1 - eps) * t + eps (LLaDA uses 1e-3)."""
    t_sampling: str = "uniform"
    """How t is drawn: uniform (independent per sequence) or antithetic (stratified across the
    global batch: t_i = frac(u + i / n))."""
    t_min: float = 0.0
    """Lowest noise level: t is drawn in [t_min, t_max) (dFactory's SFT uses [0.3, 0.8])."""
    t_max: float = 1.0
    """Highest noise level (see t_min); the default range [0, 1) is LLaDA's."""
    t_distribution: str = "uniform"
    """How t is distributed over [t_min, t_max): uniform (MDLM, LLaDA), logit_normal (logit(t) ~ N(mean,
    std^2) on the range) or beta (a bell for a, b > 1); models/difflm/t_distribution.py. Per row, per
    block (block diffusion) and per document alike; antithetic sampling stratifies its quantiles."""
    t_logit_normal_mean: float = 0.0
    """logit_normal's mean of logit(t)."""
    t_logit_normal_std: float = 1.0
    """logit_normal's standard deviation of logit(t)."""
    t_beta_a: float = 2.0
    """beta's a (>= 1)."""
    t_beta_b: float = 2.0
    """beta's b (>= 1)."""
    t_uniform_mix: float = 0.1
    """Share of uniform t in a non-uniform t's density, q = mix + (1 - mix) q_shape (a defensive mixture):
    the importance weight 1 / q stays at most 1 / mix; 0 gives the pure shape, whose weights have unbounded
    variance (logit-normal always, beta for a or b >= 2)."""
    t_importance_weight: bool = True
    """Under a non-uniform t, multiply each masked token's weight by 1 / q(t) so the loss stays an unbiased
    estimate of the ELBO over uniform t (higher variance in q's tails); False: the unweighted, biased
    surrogate that concentrates training near q's mode (its loss is not an ELBO estimate)."""
    loss_weight: str = "inverse_p"
    """Per-token weight of masked positions: inverse_p (1/p, LLaDA/MDLM), inverse_empirical
    (1 / realised masked fraction of the sequence, MegaDLMs) or none."""
    loss_normalizer: str = "tokens"
    """Divide the weighted sum by: tokens (valid tokens, B*L without padding, LLaDA), masked
    (number of masked tokens) or sequence (each sequence by its own valid length, then the mean
    over sequences)."""
    varilen_prob: float = 0.0
    """Probability that a training micro-batch is truncated to a random length (LLaDA: 0.01)."""
    varilen_multiple: int = 8
    """Truncated lengths are multiples of this (and of block_size with block_causal attention): a
    property of the run, not of the layout, so every layout truncates alike (sequence parallelism
    needs the tensor-parallel size to divide it)."""
    per_document_t: bool = False
    """With packed documents, draw an independent t for every document instead of every row."""
    seed: int = 1234
    """Seed of the corruption process; masks are a pure function of it and the sample index."""
    masked_only_loss: bool = False
    """Project onto the vocabulary and take the cross-entropy only at positions whose loss weight
    is nonzero (the masked tokens in the DLM modes, about half of them; the loss-mask positions in
    vanilla), `loss_chunk_size` tokens at a time, so fp32 logits of the whole batch never exist.
    The loss and every gradient are those of the full-logit path up to float rounding; the
    per-token losses returned are 0 at unselected positions. Selecting the positions costs one
    host sync per micro-batch (their count sets the shapes)."""
    loss_chunk_size: int = 4096
    """Tokens per chunk of the masked-only loss: peak memory is about 8 bytes x chunk x vocab / tp."""
    compile_loss: bool = False
    """With `masked_only_loss`: each chunk's softmax, loss and logits gradient run fused (a Triton
    kernel on CUDA, torch.compile's elsewhere; two Triton kernels and an all-gather under tensor
    parallelism) instead of a dozen eager passes over fp32 copies. Same values up to float rounding."""
    loss_kernel: str = "triton"
    """With `compile_loss`, which kernel fuses a chunk where Triton runs: triton (the hand-written kernel,
    fusions/fused_cross_entropy.py) or inductor (torch.compile's kernel of the same function on
    one rank; the eager passes under tensor parallelism). Same values up to float rounding; a choice of
    speed, timed one against the other by tools/benchmark/train_throughput.py --loss-kernel."""

    def __post_init__(self) -> None:
        self.attention_mask_type = MASK_TYPE_ALIASES.get(self.attention_mask_type, self.attention_mask_type)

    @property
    def is_diffusion(self) -> bool:
        return self.model_running_mode != "vanilla"

    def block_size_at(self, iteration: int) -> Optional[int]:
        """The block size of step `iteration` (0-based) under the schedule; block_size without one."""
        if not self.block_size_schedule:
            return self.block_size
        size = self.block_size
        for first, scheduled in self.block_size_schedule:
            if first > iteration:
                break
            size = int(scheduled)
        return size

    def at_iteration(self, iteration: int) -> "DLMConfig":
        """This config with step `iteration`'s block size (itself when that is block_size)."""
        return self.with_block_size(self.block_size_at(iteration))

    def with_block_size(self, size: Optional[int]) -> "DLMConfig":
        """This config with blocks of `size` (itself for None or its own size)."""
        return self if size is None or size == self.block_size else dataclasses.replace(self, block_size=size)

    @property
    def effective_mask_type(self) -> str:
        if self.block_diffusion:
            return "block_diffusion"
        if self.is_diffusion or self.attention_mask_type == "sliding_window":
            return self.attention_mask_type
        return "causal"

    @property
    def causal_clean_half(self) -> bool:
        """Block diffusion whose clean half is token-causal (the joint AR + DLM objective's mask)."""
        return self.block_diffusion and self.ar_loss_weight > 0

    def validate(self, vocab_size: Optional[int] = None, seq_length: Optional[int] = None,
                 sliding_window: Optional[int] = None) -> "DLMConfig":
        owner = "DLMConfig"
        _check_choice(owner, "model_running_mode", self.model_running_mode, RUNNING_MODES)
        _check_choice(owner, "attention_mask_type", self.attention_mask_type, ATTENTION_MASK_TYPES)
        _check_choice(owner, "t_sampling", self.t_sampling, T_SAMPLINGS)
        _check_choice(owner, "loss_weight", self.loss_weight, LOSS_WEIGHTS)
        _check_choice(owner, "loss_normalizer", self.loss_normalizer, LOSS_NORMALIZERS)
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"{owner}.eps={self.eps} must be in [0, 1)")
        if not 0.0 <= self.t_min < self.t_max <= 1.0:
            raise ValueError(f"{owner}.t_min={self.t_min} and t_max={self.t_max} must satisfy 0 <= t_min < t_max <= 1")
        self._validate_t_distribution()
        if not 0.0 <= self.varilen_prob <= 1.0:
            raise ValueError(f"{owner}.varilen_prob={self.varilen_prob} must be in [0, 1]")
        _check_positive(owner, "loss_chunk_size", self.loss_chunk_size)
        _check_positive(owner, "varilen_multiple", self.varilen_multiple)
        if self.varilen_prob > 0 and seq_length is not None and self.varilen_multiple > seq_length:
            raise ValueError(f"{owner}.varilen_multiple={self.varilen_multiple} exceeds seq_length={seq_length}: "
                             "no shorter length would be a multiple of it; lower it")
        _check_choice(owner, "loss_kernel", self.loss_kernel, LOSS_KERNELS)
        if self.compile_loss and not self.masked_only_loss:
            raise ValueError(f"{owner}.compile_loss needs masked_only_loss (--difflm-masked-only-loss)")
        if self.is_diffusion:
            if self.mask_token_id is None:
                raise ValueError(f"{owner}.mask_token_id is not set but model_running_mode="
                                 f"{self.model_running_mode!r} needs one; pass --mask-token <id>")
            if vocab_size is not None and not 0 <= self.mask_token_id < vocab_size:
                raise ValueError(f"{owner}.mask_token_id={self.mask_token_id} is outside the vocabulary "
                                 f"[0, {vocab_size}); use an id of the tokenizer or add a mask token")
        if self.block_diffusion:
            self._validate_block_diffusion(owner)
        if self.ar_loss_weight:
            self._validate_ar_loss(owner)
        if self.confidence_loss_weight:
            self._validate_confidence_loss(owner)
        if self.effective_mask_type in ("block_causal", "block_diffusion"):
            _check_positive(owner, "block_size", self.block_size)
            if seq_length is not None and seq_length % self.block_size:
                raise ValueError(f"{owner}.block_size={self.block_size} does not divide the sequence length "
                                 f"{seq_length}; choose a block size that divides it")
        if self.block_size_schedule:
            self._validate_block_size_schedule(owner, seq_length)
        if self.effective_mask_type in WINDOW_MASK_TYPES and not sliding_window:
            raise ValueError(f"{owner}.attention_mask_type={self.effective_mask_type!r} needs "
                             "TransformerConfig.sliding_window; pass --sliding-window <tokens>")
        if not self.is_diffusion and self.attention_mask_type == "sliding_window_two_sided":
            raise ValueError(f"{owner}.attention_mask_type='sliding_window_two_sided' sees later tokens, which an "
                             "autoregressive (vanilla) model must not; use sliding_window (causal)")
        return self

    def _validate_block_diffusion(self, owner: str) -> None:
        if not self.is_diffusion:
            raise ValueError(f"{owner}.block_diffusion needs a difflm running mode, not {self.model_running_mode!r}")
        if self.model_running_mode == "difflm-shift":
            raise ValueError(f"{owner}.block_diffusion predicts each block's own tokens; use difflm-noshift")
        if self.attention_mask_type != "no_mask":
            raise ValueError(f"{owner}.block_diffusion brings its own mask over [x_t ; x_0]; leave "
                             f"attention_mask_type at no_mask, not {self.attention_mask_type!r}")
        if self.per_document_t:
            raise ValueError(f"{owner}.block_diffusion draws t per block; it cannot also draw it per document")

    def _validate_ar_loss(self, owner: str) -> None:
        if not 0.0 < self.ar_loss_weight < float("inf"):
            raise ValueError(f"{owner}.ar_loss_weight={self.ar_loss_weight} must be a finite number >= 0")
        if not self.block_diffusion:
            raise ValueError(f"{owner}.ar_loss_weight rides on block diffusion's clean half; add "
                             "--difflm-block-diffusion (a block size equal to --seq-length is plain MDLM)")
        if self.loss_normalizer == "masked":
            raise ValueError(f"{owner}.ar_loss_weight shares the diffusion term's normalizer: a mean over tokens "
                             "or sequences, not over masked tokens (which the next-token term has none of); use "
                             "loss_normalizer 'tokens' or 'sequence'")

    def _validate_confidence_loss(self, owner: str) -> None:
        if not 0.0 < self.confidence_loss_weight < float("inf"):
            raise ValueError(f"{owner}.confidence_loss_weight={self.confidence_loss_weight} must be a finite number "
                             ">= 0")
        if not self.is_diffusion:
            raise ValueError(f"{owner}.confidence_loss_weight sharpens masked predictions; it needs a difflm "
                             "running mode, not 'vanilla'")
        if self.masked_only_loss:
            raise ValueError(f"{owner}.confidence_loss_weight reads the entropy from the full logits; drop "
                             "masked_only_loss (--difflm-masked-only-loss)")

    def _validate_t_distribution(self) -> None:
        owner = "DLMConfig"
        _check_choice(owner, "t_distribution", self.t_distribution, T_DISTRIBUTIONS)
        if self.t_distribution == "logit_normal":
            if not math.isfinite(self.t_logit_normal_mean):
                raise ValueError(f"{owner}.t_logit_normal_mean={self.t_logit_normal_mean} must be finite")
            if not 0.0 < self.t_logit_normal_std < float("inf"):
                raise ValueError(f"{owner}.t_logit_normal_std={self.t_logit_normal_std} must be a finite number > 0")
        if not 0.0 <= self.t_uniform_mix < 1.0:
            raise ValueError(f"{owner}.t_uniform_mix={self.t_uniform_mix} must be in [0, 1)")
        if self.t_distribution == "beta":
            for name in ("t_beta_a", "t_beta_b"):
                if not 1.0 <= getattr(self, name) < float("inf"):
                    raise ValueError(f"{owner}.{name}={getattr(self, name)} must be a finite number >= 1 (a bell, "
                                     "or flat at an end; below 1 the density has no bound and 1/q no floor)")

    def _validate_block_size_schedule(self, owner: str, seq_length: Optional[int]) -> None:
        if self.effective_mask_type not in ("block_causal", "block_diffusion"):
            raise ValueError(f"{owner}.block_size_schedule needs block diffusion or block_causal attention; add "
                             "--difflm-block-diffusion or --attention-mask-type block_causal")
        firsts = [int(first) for first, _ in self.block_size_schedule]
        if firsts[0] != 0 or any(later <= earlier for earlier, later in zip(firsts, firsts[1:])):
            raise ValueError(f"{owner}.block_size_schedule={self.block_size_schedule} must start at iteration 0 "
                             "and increase (e.g. 0:1,2000:4,4000:32)")
        for first, size in self.block_size_schedule:
            if int(size) < 1 or (seq_length is not None and seq_length % int(size)):
                raise ValueError(f"{owner}.block_size_schedule: the block size {size} (from iteration {first}) "
                                 f"must be a positive divisor of the sequence length {seq_length}")
