"""TransformerLayer's slots: the attention and the MLP are arguments (an MoE layer is one)."""

import torch
from torch import nn

from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

CONFIG = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=32,
                           attention_backend="math")


class Doubling(nn.Module):
    """A stand-in for any MLP-shaped module: [s, b, h] -> [s, b, h]."""

    def forward(self, x):
        return 2 * x


def test_an_mlp_given_to_the_layer_replaces_the_dense_one():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 16)
    mask = AttentionMask("no_mask")
    custom = TransformerLayer(CONFIG, 0, mlp=Doubling()).eval()
    dense = TransformerLayer(CONFIG, 0).eval()
    assert isinstance(custom.mlp, Doubling) and isinstance(dense.mlp, MLP)
    assert "mlp.linear_fc1.weight" not in dict(custom.named_parameters())
    custom.load_state_dict({k: v for k, v in dense.state_dict().items() if not k.startswith("mlp.")})
    with torch.no_grad():
        after_attention = x + dense.self_attention(dense.input_layernorm(x), mask, None)
        expected = after_attention + 2 * dense.pre_mlp_layernorm(after_attention)
        torch.testing.assert_close(custom(x, mask), expected)
