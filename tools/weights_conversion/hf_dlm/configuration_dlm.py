"""Configuration of a MegaDLMs model exported to Hugging Face (remote code, `trust_remote_code=True`).

Written by tools/weights_conversion/megatron_to_hf.py next to modeling_dlm.py and the weights.
Every field comes from the training checkpoint's metadata, so the exported model computes what
the trained one did: RoPE base and rotary fraction, norm type and epsilon, GQA, QK-norm, biases,
tied or untied output layer, the attention pattern and the running mode.
"""

from transformers import PretrainedConfig

RUNNING_MODES = ("difflm-noshift", "difflm-shift", "vanilla")
ATTENTION_MASK_TYPES = ("no_mask", "causal", "block_causal", "sliding_window")


class DLMConfig(PretrainedConfig):
    """A Llama/Qwen3-like decoder whose attention pattern and loss alignment follow the running mode.

    model_running_mode: difflm-noshift (position i predicts token i, bidirectional by default),
        difflm-shift (position i predicts token i+1, AR-initialised DLMs) or vanilla (causal AR).
    attention_mask_type: the trained pattern, in MegaDLMs' names: no_mask (bidirectional),
        causal, block_causal (with attention_block_size) or sliding_window (with sliding_window).
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
                 **kwargs):
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
        self.sliding_window = sliding_window
        self.mask_token_id = mask_token_id
        self._check()
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self):
        if self.model_running_mode not in RUNNING_MODES:
            raise ValueError(f"model_running_mode={self.model_running_mode!r} is not one of {RUNNING_MODES}")
        if self.attention_mask_type not in ATTENTION_MASK_TYPES:
            raise ValueError(f"attention_mask_type={self.attention_mask_type!r} is not one of {ATTENTION_MASK_TYPES}")
        if self.model_running_mode == "vanilla" and self.attention_mask_type != "causal":
            raise ValueError("model_running_mode='vanilla' attends causally; set attention_mask_type='causal'")
        if self.attention_mask_type == "block_causal" and not self.attention_block_size:
            raise ValueError("attention_mask_type='block_causal' needs attention_block_size")
        if self.attention_mask_type == "sliding_window" and not self.sliding_window:
            raise ValueError("attention_mask_type='sliding_window' needs sliding_window")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization={self.normalization!r} is not RMSNorm or LayerNorm")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def is_diffusion(self):
        return self.model_running_mode != "vanilla"
