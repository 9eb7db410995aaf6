"""Tensor names and layouts: MegaDLMs checkpoint tensors <-> Hugging Face Llama/Qwen-style tensors.

Ours (global, layout-independent shapes; G kv groups, P = heads / G, d head dim, h hidden, f ffn):

    embedding.word_embeddings.weight                 [V_padded, h]  -> model.embed_tokens.weight [V, h]
    decoder.layers.i.input_layernorm.{weight,bias}                  -> model.layers.i.input_layernorm.*
    decoder.layers.i.self_attention.linear_qkv.weight [G, P+2, d, h] -> self_attn.{q,k,v}_proj.weight
        (per kv group: its P query heads, then its key head, then its value head)
    decoder.layers.i.self_attention.linear_qkv.bias   [G, P+2, d]    -> self_attn.{q,k,v}_proj.bias
    decoder.layers.i.self_attention.{q,k}_layernorm.* [d]            -> self_attn.{q,k}_norm.*
    decoder.layers.i.self_attention.linear_proj.*     [h, H*d]       -> self_attn.o_proj.*
    decoder.layers.i.pre_mlp_layernorm.*                             -> model.layers.i.post_attention_layernorm.*
    decoder.layers.i.mlp.linear_fc1.weight            [2, f, h]      -> mlp.gate_proj ([0]), mlp.up_proj ([1])
        (not gated: [f, h] -> mlp.up_proj)
    decoder.layers.i.mlp.linear_fc2.*                 [h, f]         -> mlp.down_proj.*
    decoder.final_layernorm.*                                        -> model.norm.*
    output_layer.weight                               [V_padded, h]  -> lm_head.weight (untied only)

Vocabulary tensors keep only the first V (unpadded) rows. Every tensor is checked against the
shape the config implies; a mismatch names the tensor and both shapes.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

Shape = Tuple[int, ...]


class ShapeMismatchError(ValueError):
    pass


def check_shape(name: str, tensor: torch.Tensor, expected: Shape, where: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ShapeMismatchError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, but the config "
                                 f"implies {tuple(expected)}")


def _norm_params(config: TransformerConfig) -> List[str]:
    return ["weight", "bias"] if config.normalization == "LayerNorm" else ["weight"]


def _dims(config: TransformerConfig):
    groups, heads, dim = config.num_query_groups, config.num_attention_heads, config.kv_channels
    return groups, heads // groups, dim, config.hidden_size, config.ffn_hidden_size, heads


def layer_names(config: TransformerConfig) -> List[str]:
    """Our per-layer tensor names (relative to `decoder.layers.i.`) for this architecture."""
    names = [f"input_layernorm.{p}" for p in _norm_params(config)]
    names += [f"pre_mlp_layernorm.{p}" for p in _norm_params(config)]
    names.append("self_attention.linear_qkv.weight")
    if config.add_bias_linear or config.add_qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if config.qk_layernorm:
        names += [f"self_attention.{which}_layernorm.{p}" for which in "qk" for p in _norm_params(config)]
    for linear in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        names += [f"{linear}.weight"] + ([f"{linear}.bias"] if config.add_bias_linear else [])
    return names


def global_names(config: TransformerConfig) -> List[str]:
    names = ["embedding.word_embeddings.weight"] + [f"decoder.final_layernorm.{p}" for p in _norm_params(config)]
    if not config.share_embeddings_and_output_weights:
        names.append("output_layer.weight")
    return names


def our_shape(config: TransformerConfig, name: str) -> Shape:
    """The global shape of one of our per-layer tensors (name relative to the layer)."""
    groups, per_group, dim, hidden, ffn, heads = _dims(config)
    param = name.rsplit(".", 1)[1]
    if "layernorm" in name:
        return (dim,) if name.startswith("self_attention.") else (hidden,)
    if "linear_qkv" in name:
        return (groups, per_group + 2, dim, hidden) if param == "weight" else (groups, per_group + 2, dim)
    if "linear_proj" in name:
        return (hidden, heads * dim) if param == "weight" else (hidden,)
    if "linear_fc1" in name:
        rows = (2, ffn) if config.gated_linear_unit else (ffn,)
        return (*rows, hidden) if param == "weight" else rows
    if "linear_fc2" in name:
        return (hidden, ffn) if param == "weight" else (hidden,)
    raise KeyError(name)


# ---------------------------------------------------------------------- per layer
_RENAMES = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
            "self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm",
            "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}


def layer_to_hf(config: TransformerConfig, index: int, ours: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One layer's tensors (our names relative to `decoder.layers.i.`) -> HF names."""
    groups, per_group, dim, hidden, ffn, heads = _dims(config)
    prefix = f"model.layers.{index}."
    hf = {}
    for name in layer_names(config):
        tensor = ours[name]
        check_shape(f"decoder.layers.{index}.{name}", tensor, our_shape(config, name), "checkpoint")
        module, param = name.rsplit(".", 1)
        if module == "self_attention.linear_qkv":
            tail = tensor.shape[3:]
            hf[f"{prefix}self_attn.q_proj.{param}"] = tensor[:, :per_group].reshape(heads * dim, *tail)
            hf[f"{prefix}self_attn.k_proj.{param}"] = tensor[:, per_group].reshape(groups * dim, *tail)
            hf[f"{prefix}self_attn.v_proj.{param}"] = tensor[:, per_group + 1].reshape(groups * dim, *tail)
        elif module == "mlp.linear_fc1":
            if config.gated_linear_unit:
                hf[f"{prefix}mlp.gate_proj.{param}"], hf[f"{prefix}mlp.up_proj.{param}"] = tensor[0], tensor[1]
            else:
                hf[f"{prefix}mlp.up_proj.{param}"] = tensor
        else:
            hf[f"{prefix}{_RENAMES[module]}.{param}"] = tensor
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def layer_from_hf(config: TransformerConfig, index: int,
                  get: Callable[[str], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One layer's HF tensors (read with `get(hf_name)`) -> our names relative to `decoder.layers.i.`."""
    groups, per_group, dim, hidden, ffn, heads = _dims(config)
    prefix = f"model.layers.{index}."

    def read(hf_name: str, shape: Shape) -> torch.Tensor:
        tensor = get(prefix + hf_name)
        check_shape(prefix + hf_name, tensor, shape, "Hugging Face checkpoint")
        return tensor

    ours = {}
    for name in layer_names(config):
        module, param = name.rsplit(".", 1)
        shape = our_shape(config, name)
        if module == "self_attention.linear_qkv":
            tail = shape[3:]
            query = read(f"self_attn.q_proj.{param}", (heads * dim, *tail)).reshape(groups, per_group, dim, *tail)
            key = read(f"self_attn.k_proj.{param}", (groups * dim, *tail)).reshape(groups, 1, dim, *tail)
            value = read(f"self_attn.v_proj.{param}", (groups * dim, *tail)).reshape(groups, 1, dim, *tail)
            ours[name] = torch.cat([query, key, value], dim=1)
        elif module == "mlp.linear_fc1":
            tail = (hidden,) if param == "weight" else ()
            if config.gated_linear_unit:
                ours[name] = torch.stack([read(f"mlp.gate_proj.{param}", (ffn, *tail)),
                                          read(f"mlp.up_proj.{param}", (ffn, *tail))])
            else:
                ours[name] = read(f"mlp.up_proj.{param}", shape)
        else:
            ours[name] = read(f"{_RENAMES[module]}.{param}", shape)
    return ours


# ---------------------------------------------------------------------- outside the layers
def globals_to_hf(config: TransformerConfig, ours: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    vocab, hidden = config.unpadded_vocab_size or config.vocab_size, config.hidden_size
    hf = {}
    for name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                          ("output_layer.weight", "lm_head.weight")):
        if name not in ours:
            continue
        tensor = ours[name]
        if tensor.dim() != 2 or tensor.shape[1] != hidden or tensor.shape[0] < vocab:
            raise ShapeMismatchError(f"checkpoint: tensor {name} has shape {tuple(tensor.shape)}, but the config "
                                     f"implies ({vocab} + padding, {hidden})")
        hf[hf_name] = tensor[:vocab].contiguous()
    for param in _norm_params(config):
        tensor = ours[f"decoder.final_layernorm.{param}"]
        check_shape(f"decoder.final_layernorm.{param}", tensor, (hidden,), "checkpoint")
        hf[f"model.norm.{param}"] = tensor
    return hf


def globals_from_hf(config: TransformerConfig, get: Callable[[str], torch.Tensor]) -> Dict[str, torch.Tensor]:
    vocab, hidden = config.unpadded_vocab_size or config.vocab_size, config.hidden_size

    def read(hf_name: str, shape: Shape) -> torch.Tensor:
        tensor = get(hf_name)
        check_shape(hf_name, tensor, shape, "Hugging Face checkpoint")
        return tensor

    ours = {"embedding.word_embeddings.weight": read("model.embed_tokens.weight", (vocab, hidden))}
    for param in _norm_params(config):
        ours[f"decoder.final_layernorm.{param}"] = read(f"model.norm.{param}", (hidden,))
    if not config.share_embeddings_and_output_weights:
        ours["output_layer.weight"] = read("lm_head.weight", (vocab, hidden))
    return ours


def hf_names(config: TransformerConfig) -> List[str]:
    """Every HF tensor name of this architecture (what an export writes, what an import reads)."""
    names = ["model.embed_tokens.weight"] + [f"model.norm.{p}" for p in _norm_params(config)]
    if not config.share_embeddings_and_output_weights:
        names.append("lm_head.weight")
    fake = {name: torch.empty(our_shape(config, name), device="meta") for name in layer_names(config)}
    for index in range(config.num_layers):
        names += list(layer_to_hf(config, index, fake))
    return names
