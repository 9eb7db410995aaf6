"""A MegaDLMs model as a Hugging Face PreTrainedModel (remote code, `trust_remote_code=True`).

Llama/Qwen3-style decoder: RMSNorm (or LayerNorm), rotate-half RoPE on the first
`rotary_percent` of each head, GQA, optional QK-norm (before RoPE: per head, or over the whole
q / k projection with `qk_norm_scope='all'`, OLMoE-style), optional biases, SwiGLU (or a plain
activation) MLP, tied or untied output layer. Mixture-of-experts layers (`num_experts`, the layers
`moe_layer_flags` marks) route each token as MegaDLMs does (router.py): softmax over the top-k
logits, or over all experts before the top-k (`router_pre_softmax`), or sigmoid scores with an
optional selection-only expert bias; an optional scaling factor and per-batch capacity; or
expert choice (each expert takes its top-capacity tokens of every sequence). The output is the
routing-weighted sum of the chosen experts' MLPs plus an optional shared expert. The attention pattern is the
trained one (`config.attention_mask_type`): bidirectional in the difflm-* modes by default,
causal in vanilla. Numerics follow MegaDLMs (fp32 norms, RoPE tables computed in float64), so
an fp32 export reproduces the training model's logits to rounding.

Two entry points:
- `forward(input_ids, attention_mask=None, position_ids=None, labels=None)`: the usual HF call;
  `attention_mask` [B, L] marks real tokens (1) and padding (0, never attended to), position ids
  default to the count of real tokens before each position (left padding works).
- `dlm_forward(input_ids, position_ids, attention_mask, kv_cache=None, cache_start=0)`: the
  `model_fn` of MegaDLMs' sampler (generation.py, copied next to this file): `attention_mask`
  [B, q, K] bool (True = may attend), used as given; with a cache every layer writes its k/v at
  [cache_start, cache_start + q) through `kv_cache.update` and attends the returned buffers.
`generate(input_ids, attention_mask=None, cuda_graphs=False, **options)` runs that sampler in
the running mode; `cuda_graphs=True` replays a captured CUDA graph per forward shape
(cuda_graphs.py, also copied next to this file). `log_likelihood(prompt, answer, **options)`
scores an answer (likelihood.py: LLaDA's Monte Carlo ELBO for DLMs, exact for AR).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_dlm import DLMConfig
from .cuda_graphs import runner_for
from .likelihood import log_likelihood as _log_likelihood
from .rope_scaling import SCALING_DEFAULTS, inverse_frequencies
from .generation import generate as _sampler_generate
from .kv_cache import KVCache  # noqa: F401 (for callers)
from .generation_options import autoregressive_decoding

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class DLMRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Statistics in fp32 whatever the activation dtype, as in training.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class DLMLayerNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def build_norm(config, dim):
    norm = DLMRMSNorm if config.normalization == "RMSNorm" else DLMLayerNorm
    return norm(dim, config.rms_norm_eps)


def rotary_cos_sin(config, position_ids):
    """cos, sin [B, 1, q, rotary_dim] in fp32, computed in float64 like the training tables (the same
    rope_scaling.py: Llama 3.1 or YaRN frequencies, YaRN's attention factor folded into both)."""
    rotary_dim = int(config.head_dim * config.rotary_percent)
    scaling = {name: getattr(config, name, default) for name, default in SCALING_DEFAULTS.items()}
    inv_freq, scale = inverse_frequencies(rotary_dim, config.rope_theta, scaling, position_ids.device)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).float().unsqueeze(1), (angles.sin() * scale).float().unsqueeze(1)


def apply_rotary(x, cos, sin):
    """Rotate-half RoPE on the first rotary_dim channels of x [B, heads, q, d]; the rest pass."""
    rotary_dim = cos.shape[-1]
    rotated, passthrough = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = (rotated * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)
    return torch.cat([rotated, passthrough], dim=-1) if passthrough.shape[-1] else rotated


class DLMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        self.whole_qk_norm = config.qk_norm and config.qk_norm_scope == "all"
        if self.whole_qk_norm:  # over all heads' channels, before the split into heads
            self.q_norm = build_norm(config, self.num_heads * self.head_dim)
            self.k_norm = build_norm(config, self.num_kv_heads * self.head_dim)
        elif config.qk_norm:
            self.q_norm, self.k_norm = build_norm(config, self.head_dim), build_norm(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden_states, cos, sin, mask, kv_cache=None, cache_start=0):
        batch, length, _ = hidden_states.shape
        query, key = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.whole_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.view(batch, length, self.num_heads, self.head_dim)
        key = key.view(batch, length, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden_states).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.whole_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if kv_cache is not None:
            key, value = kv_cache.update(self.layer_idx, cache_start, key, value)
        repeats = self.num_heads // self.num_kv_heads
        if repeats > 1:  # query head h reads kv head h // repeats
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        context = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask)
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class DLMMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        inner = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias) if config.gated_mlp else None
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        if self.gate_proj is None:
            return self.down_proj(self.activation(self.up_proj(x)))
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


def expert_capacity(config, num_tokens):
    """Assignments one expert takes out of `num_tokens` (MoEConfig.expert_capacity)."""
    factor = 1.0 if config.expert_capacity_factor is None else config.expert_capacity_factor
    return min(num_tokens, max(1, math.ceil(num_tokens * config.num_experts_per_tok / config.num_experts * factor)))


class DLMRouter(nn.Module):
    """The gate [E, h] (fp32 logits) and the routing rule: (probs [T, E] fp32, routing_map [T, E] bool)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        # Aux-loss-free balancing's bias: moves the selection only, never the weights.
        self.expert_bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                            if config.router_expert_bias else None)

    def forward(self, tokens, batch, length):
        logits = F.linear(tokens.float(), self.weight.float())
        if self.config.router_type == "expert_choice":
            return self._expert_choice(logits, batch, length)
        return self._token_choice(logits)

    def _token_choice(self, logits):
        config, topk = self.config, self.config.num_experts_per_tok
        if config.router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            selection = scores if self.expert_bias is None else scores + self.expert_bias.float()
            indices = selection.topk(topk, dim=-1).indices
            top = scores.gather(-1, indices)
            top = top / (top.sum(-1, keepdim=True) + 1e-20) if topk > 1 else top
        elif config.router_pre_softmax:
            top, indices = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
        else:
            top_logits, indices = logits.topk(topk, dim=-1)
            top = torch.softmax(top_logits, dim=-1)
        if config.router_topk_scaling_factor is not None:
            top = top * config.router_topk_scaling_factor
        probs = torch.zeros_like(logits).scatter(-1, indices, top)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, indices, True)
        if config.expert_capacity_factor is not None:  # each expert keeps its most probable assignments
            kept = probs.masked_fill(~routing_map, -1.0).topk(expert_capacity(config, probs.shape[0]), dim=0).indices
            routing_map = torch.zeros_like(routing_map).scatter(0, kept, True) & routing_map
            probs = probs * routing_map
        return probs, routing_map

    def _expert_choice(self, logits, batch, length):
        """Each expert takes, in every sequence, the tokens with its `capacity` highest scores."""
        scores = torch.softmax(logits, dim=-1).view(batch, length, -1)
        threshold = scores.topk(expert_capacity(self.config, length), dim=1).values[:, -1:]  # [B, 1, E]
        routing_map = scores >= threshold
        return (scores * routing_map).flatten(0, 1), routing_map.flatten(0, 1)


class DLMSparseMoeBlock(nn.Module):
    """Router, routed experts (one MLP each) and an optional shared expert every token goes through."""

    def __init__(self, config):
        super().__init__()
        self.gate = DLMRouter(config)
        self.experts = nn.ModuleList(DLMMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = DLMMLP(config, shared) if shared else None

    def forward(self, hidden_states):
        batch, length, width = hidden_states.shape
        tokens = hidden_states.reshape(-1, width)
        probs, routing_map = self.gate(tokens, batch, length)
        output = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        # While a CUDA graph is captured no row count may be read back: every expert sees every token.
        dense = tokens.is_cuda and torch.cuda.is_current_stream_capturing()
        for index, expert in enumerate(self.experts):
            if dense:
                output = output + expert(tokens).float() * probs[:, index, None]
                continue
            rows = routing_map[:, index].nonzero(as_tuple=True)[0]
            if rows.numel():
                output.index_add_(0, rows, expert(tokens[rows]).float() * probs[rows, index, None])
        output = output.to(hidden_states.dtype).view(batch, length, width)
        return output if self.shared_expert is None else output + self.shared_expert(hidden_states)


class DLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attn = DLMAttention(config, layer_idx)
        self.post_attention_layernorm = build_norm(config, config.hidden_size)
        self.mlp = DLMSparseMoeBlock(config) if config.is_moe_layer(layer_idx) else DLMMLP(config)

    def forward(self, hidden_states, cos, sin, mask, kv_cache=None, cache_start=0):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, mask,
                                                       kv_cache, cache_start)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def pattern_mask(config, length, device):
    """[q, k] bool of the trained attention pattern, or None when every query sees every key."""
    kind = config.attention_mask_type
    if kind == "no_mask":
        return None
    query = torch.arange(length, device=device).unsqueeze(1)
    key = torch.arange(length, device=device).unsqueeze(0)
    if kind == "causal":
        return key <= query
    if kind == "block_diffusion" and getattr(config, "ar_loss_weight", 0.0) > 0:  # a joint model's clean half
        return key <= query
    if kind in ("block_causal", "block_diffusion"):  # block diffusion: the input read as clean blocks
        size = config.attention_block_size
        return key // size <= query // size
    if kind == "sliding_window_two_sided":
        return (query - key).abs() < config.sliding_window
    return (query - key >= 0) & (query - key < config.sliding_window)


def _no_empty_rows(mask):
    """A query allowed no key at all (a padding row) attends everywhere instead of producing NaN;
    its output is ignored by every caller."""
    return mask | ~mask.any(dim=-1, keepdim=True)


class DLMPreTrainedModel(PreTrainedModel):
    config_class = DLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DLMDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DLMRouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.expert_bias is not None:
                nn.init.zeros_(module.expert_bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (DLMRMSNorm, DLMLayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class DLMModel(DLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DLMDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = build_norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def run(self, input_ids, position_ids, mask, kv_cache=None, cache_start=0):
        """Final hidden states [B, q, h]; `mask` is an SDPA mask ([B, 1, q, K] bool) or None."""
        # Not while a CUDA graph is captured (no host syncs there); that shape's eager first call checked.
        capturing = position_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(position_ids.max())} is beyond max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        cos, sin = rotary_cos_sin(self.config, position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, kv_cache, cache_start)
        return self.norm(hidden)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        position_ids, mask = padded_positions_and_mask(self.config, input_ids, attention_mask, position_ids)
        return BaseModelOutput(last_hidden_state=self.run(input_ids, position_ids, mask))


def padded_positions_and_mask(config, input_ids, attention_mask, position_ids):
    """Position ids and the [B, 1, L, L] mask of the trained pattern with padded keys removed."""
    batch, length = input_ids.shape
    pattern = pattern_mask(config, length, input_ids.device)
    if attention_mask is None:
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        return position_ids, (None if pattern is None else pattern.expand(batch, 1, length, length))
    real = attention_mask.to(torch.bool)
    if position_ids is None:
        position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    mask = real[:, None, None, :].expand(batch, 1, length, length)
    if pattern is not None:
        mask = mask & pattern
    return position_ids, _no_empty_rows(mask)


class DLMForCausalLM(DLMPreTrainedModel):
    _tied_weights_keys = None  # a tied model has no lm_head: the logits read embed_tokens directly

    def __init__(self, config):
        super().__init__(config)
        self.model = DLMModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def _logits(self, hidden):
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, return_dict=None, **kwargs):
        """Logits [B, L, V]. With `labels` [B, L] (-100 = ignored) the loss is the mean cross-entropy in
        the running mode's alignment: position i predicts labels[i] (difflm-noshift) or labels[i+1]."""
        position_ids, mask = padded_positions_and_mask(self.config, input_ids, attention_mask, position_ids)
        logits = self._logits(self.model.run(input_ids, position_ids, mask))
        loss = None
        if labels is not None:
            predicted, targets = logits, labels
            if self.config.model_running_mode != "difflm-noshift":
                predicted, targets = logits[:, :-1], labels[:, 1:]
            loss = F.cross_entropy(predicted.float().reshape(-1, predicted.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def dlm_forward(self, input_ids, position_ids, attention_mask=None, kv_cache=None, cache_start=0, select=None):
        """The sampler's model_fn: fp32 logits [B, q, V]. `attention_mask` [B, q, K] bool is used as
        given (None: the trained pattern over the q tokens, no cache). `select` ([B, q] bool, or
        (rows, positions) index tensors): only those positions' logits, [n, V] as ``logits[select]``."""
        if attention_mask is None:
            if kv_cache is not None:
                raise ValueError("dlm_forward with a kv_cache needs an explicit [B, q, K] attention_mask")
            pattern = pattern_mask(self.config, input_ids.shape[1], input_ids.device)
            mask = None if pattern is None else pattern[None, None]
        else:
            key_length = kv_cache.max_length if kv_cache is not None else input_ids.shape[1]
            if attention_mask.shape != (input_ids.shape[0], input_ids.shape[1], key_length):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                                 f"{(input_ids.shape[0], input_ids.shape[1], key_length)} [B, q, K]")
            mask = _no_empty_rows(attention_mask.to(torch.bool)).unsqueeze(1)
        hidden = self.model.run(input_ids, position_ids, mask, kv_cache, cache_start)
        return self._logits(hidden if select is None else hidden[select]).float()

    def trained_pattern(self):
        config = self.config
        pattern = dict(attention_mask_type=config.attention_mask_type, attention_block_size=config.attention_block_size,
                       sliding_window=config.sliding_window)
        if config.attention_mask_type == "block_diffusion" and getattr(config, "ar_loss_weight", 0.0) > 0:
            pattern["causal_clean"] = True  # the joint AR + DLM objective's clean blocks
        return pattern

    def log_likelihood(self, prompt, answer, **options):
        """log p(answer | prompt) for 1-D id tensors (likelihood.py): LLaDA's Monte Carlo ELBO in the
        diffusion modes (mc_num, batch_size, cfg_scale, generator), exact in vanilla."""
        return _log_likelihood(self.dlm_forward, prompt, answer, running_mode=self.config.model_running_mode,
                               mask_token_id=self.config.mask_token_id, **(self.trained_pattern() | options))

    def generate(self, input_ids, attention_mask=None, cuda_graphs=False, autoregressive=False, **options):
        """MegaDLMs' sampler (generation.py) in this model's running mode and attention pattern
        (`autoregressive`: token by token, causal, for a joint AR + DLM model, config.ar_loss_weight > 0).
        Options are those of generation.generate (steps, block length, temperature, remasking, ...).
        `cuda_graphs`: replay a captured CUDA graph per forward shape (cuda_graphs.py); the graphs
        stay with the model for later calls of the same sizes."""
        config = self.config
        generation_config = getattr(self, "generation_config", None)

        def special(name):
            value = getattr(config, name, None)
            return value if value is not None else getattr(generation_config, name, None)

        defaults = dict(running_mode=config.model_running_mode, mask_token_id=config.mask_token_id,
                        eos_token_id=special("eos_token_id"), pad_token_id=special("pad_token_id"),
                        **self.trained_pattern())
        if autoregressive:
            mode, pattern = autoregressive_decoding(config.model_running_mode, self.trained_pattern())
            defaults = {key: defaults[key] for key in ("mask_token_id", "eos_token_id", "pad_token_id")}
            defaults.update(running_mode=mode, **pattern)
        model_fn = self.dlm_forward
        if cuda_graphs:
            model_fn = self._graph_runner = runner_for(self, self.dlm_forward, getattr(self, "_graph_runner", None))
        return _sampler_generate(model_fn, input_ids, attention_mask, **(defaults | options))


# The class name MegaDLMs users look for.
DiffLM = DLMForCausalLM

__all__ = ["DLMPreTrainedModel", "DLMModel", "DLMForCausalLM", "DiffLM"]
