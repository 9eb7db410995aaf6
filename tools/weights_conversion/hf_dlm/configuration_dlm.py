"""Configuration of a MegaDLMs model exported to Hugging Face (remote code, `trust_remote_code=True`).

Written by tools/weights_conversion/megatron_to_hf.py next to modeling_dlm.py and the weights.
Every field comes from the training checkpoint's metadata, so the exported model computes what
the trained one did: RoPE base, rotary fraction and scaling, norm type and epsilon, GQA, QK-norm (per head
or over the whole projection), biases, tied or untied output layer, mixture-of-experts layers and
their routing, the attention pattern and the running mode.
"""

from transformers import PretrainedConfig

RUNNING_MODES = ("difflm-noshift", "difflm-shift", "vanilla")
ATTENTION_MASK_TYPES = ("no_mask", "causal", "block_causal", "sliding_window", "sliding_window_two_sided")
# Block diffusion (BD3-LM) checkpoints: generate() goes block by block; a plain forward attends block-causally.
SAMPLER_MASK_TYPES = ATTENTION_MASK_TYPES + ("block_diffusion",)
QK_NORM_SCOPES = ("head", "all")
ROUTER_TYPES = ("token_choice", "expert_choice")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


class DLMConfig(PretrainedConfig):
    """A Llama/Qwen3-like decoder whose attention pattern and loss alignment follow the running mode.

    model_running_mode: difflm-noshift (position i predicts token i, bidirectional by default),
        difflm-shift (position i predicts token i+1, AR-initialised DLMs) or vanilla (causal AR).
    attention_mask_type: the trained pattern, in MegaDLMs' names: no_mask (bidirectional),
        causal, block_causal (with attention_block_size) or sliding_window (with sliding_window: key
        j visible from query i when 0 <= i - j < sliding_window; vanilla may use it too),
        sliding_window_two_sided (DLMs: key j visible when |i - j| < sliding_window), or
        block_diffusion (BD3-LM, with attention_block_size: generate() denoises block by block over
        an exact cache of the clean blocks; a plain forward reads its input as clean blocks).
    ar_loss_weight: > 0 for a block-diffusion model trained with the joint AR + DLM objective: its clean
        blocks are token-causal (a plain forward is then an AR model's), and generate(autoregressive=True)
        decodes it token by token.
    rope_scaling_type: none, llama3 or yarn, with that type's settings under MegaDLMs'
        TransformerConfig names (rope_scaling_factor, ..., yarn_rotary_scaling_factor, ...); their
        formulas are rope_scaling.py, the file training uses.
    qk_norm_scope: head (each head's channels) or all (the whole q / k projection, OLMoE).
    num_experts: routed experts of the MoE layers (None: a dense model); moe_layer_flags: 1 where
        layer i is MoE (default every layer); num_experts_per_tok, moe_intermediate_size,
        shared_expert_intermediate_size; router_type (token_choice or expert_choice),
        router_score_function (softmax or sigmoid), router_pre_softmax (softmax over all experts
        before the top-k, no renormalisation), router_expert_bias (a selection-only bias),
        router_topk_scaling_factor, expert_capacity_factor: MegaDLMs' MoEConfig fields.
    """

    model_type = "megadlm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                 gated_mlp=True, normalization="RMSNorm", rms_norm_eps=1e-6, qk_norm=False, qkv_bias=False,
                 o_proj_bias=False, mlp_bias=False, rope_theta=10000.0, rotary_percent=1.0,
                 max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=True,
                 model_running_mode="difflm-noshift", attention_mask_type=None, attention_block_size=None,
                 sliding_window=None, mask_token_id=None, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                 qk_norm_scope="head", num_experts=None, num_experts_per_tok=None, moe_intermediate_size=None,
                 shared_expert_intermediate_size=None, moe_layer_flags=None, router_type="token_choice",
                 router_score_function="softmax", router_pre_softmax=False, router_expert_bias=False,
                 router_topk_scaling_factor=None, expert_capacity_factor=None, rope_scaling_type="none",
                 ar_loss_weight=0.0, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.normalization = normalization
        self.rms_norm_eps = rms_norm_eps
        self.qk_norm = qk_norm
        self.qkv_bias = qkv_bias
        self.o_proj_bias = o_proj_bias
        self.mlp_bias = mlp_bias
        self.rope_theta = rope_theta
        self.rotary_percent = rotary_percent
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.model_running_mode = model_running_mode
        if attention_mask_type is None:
            attention_mask_type = "causal" if model_running_mode == "vanilla" else "no_mask"
        self.attention_mask_type = attention_mask_type
        self.attention_block_size = attention_block_size
        self.ar_loss_weight = ar_loss_weight
        self.sliding_window = sliding_window
        self.mask_token_id = mask_token_id
        self.qk_norm_scope = qk_norm_scope
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        if num_experts and moe_layer_flags is None:
            moe_layer_flags = [1] * num_hidden_layers
        self.moe_layer_flags = moe_layer_flags
        self.router_type, self.router_score_function = router_type, router_score_function
        self.router_pre_softmax, self.router_expert_bias = router_pre_softmax, router_expert_bias
        self.router_topk_scaling_factor = router_topk_scaling_factor
        self.expert_capacity_factor = expert_capacity_factor
        self.rope_scaling_type = rope_scaling_type  # its settings stay in kwargs: attributes by their names
        self._check()
        self._check_moe()
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self):
        if self.model_running_mode not in RUNNING_MODES:
            raise ValueError(f"model_running_mode={self.model_running_mode!r} is not one of {RUNNING_MODES}")
        if self.attention_mask_type not in SAMPLER_MASK_TYPES:
            raise ValueError(f"attention_mask_type={self.attention_mask_type!r} is not one of {SAMPLER_MASK_TYPES}")
        if self.model_running_mode == "vanilla" and self.attention_mask_type not in ("causal", "sliding_window"):
            raise ValueError("model_running_mode='vanilla' attends causally; set attention_mask_type='causal' "
                             "(or 'sliding_window')")
        if self.rope_scaling_type not in ("none", "llama3", "yarn"):
            raise ValueError(f"rope_scaling_type={self.rope_scaling_type!r} is not one of none, llama3, yarn")
        if self.attention_mask_type in ("block_causal", "block_diffusion") and not self.attention_block_size:
            raise ValueError(f"attention_mask_type={self.attention_mask_type!r} needs attention_block_size")
        if self.attention_mask_type in ("sliding_window", "sliding_window_two_sided") and not self.sliding_window:
            raise ValueError(f"attention_mask_type={self.attention_mask_type!r} needs sliding_window")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization={self.normalization!r} is not RMSNorm or LayerNorm")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def _check_moe(self):
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope={self.qk_norm_scope!r} is not one of {QK_NORM_SCOPES}")
        if not self.num_experts:
            return
        if not self.num_experts_per_tok or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok!r} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if not self.moe_intermediate_size:
            raise ValueError("num_experts is set: set moe_intermediate_size, the experts' inner width")
        if len(self.moe_layer_flags) != self.num_hidden_layers or any(f not in (0, 1) for f in self.moe_layer_flags):
            raise ValueError(f"moe_layer_flags={self.moe_layer_flags!r} must be a 0 or 1 for each of the "
                             f"{self.num_hidden_layers} layers")
        if self.router_type not in ROUTER_TYPES:
            raise ValueError(f"router_type={self.router_type!r} is not one of {ROUTER_TYPES}")
        if self.router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"router_score_function={self.router_score_function!r} is not one of {SCORE_FUNCTIONS}")

    def is_moe_layer(self, index):
        return bool(self.num_experts) and bool(self.moe_layer_flags[index])

    @property
    def is_diffusion(self):
        return self.model_running_mode != "vanilla"
