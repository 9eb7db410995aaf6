"""Tensor names and layouts: MegaDLMs checkpoint tensors <-> Hugging Face Llama/Qwen-style tensors.

Ours (global, layout-independent shapes; G kv groups, P = heads / G, d head dim, h hidden, f ffn):

    embedding.word_embeddings.weight                 [V_padded, h]  -> model.embed_tokens.weight [V, h]
    decoder.layers.i.input_layernorm.{weight,bias}                  -> model.layers.i.input_layernorm.*
    decoder.layers.i.self_attention.linear_qkv.weight [G, P+2, d, h] -> self_attn.{q,k,v}_proj.weight
        (per kv group: its P query heads, then its key head, then its value head)
    decoder.layers.i.self_attention.linear_qkv.bias   [G, P+2, d]    -> self_attn.{q,k,v}_proj.bias
    decoder.layers.i.self_attention.{q,k}_layernorm.* [d]            -> self_attn.{q,k}_norm.*
        (qk_layernorm_scope='all', OLMoE: q [H*d], k [G*d], in the q_proj / k_proj row order: head
        g*P + p of the fused layout is HF head g*P + p, so the weight maps as it is)
    decoder.layers.i.self_attention.linear_proj.*     [h, H*d]       -> self_attn.o_proj.*
    decoder.layers.i.pre_mlp_layernorm.*                             -> model.layers.i.post_attention_layernorm.*
    decoder.layers.i.mlp.linear_fc1.weight            [2, f, h]      -> mlp.gate_proj ([0]), mlp.up_proj ([1])
        (not gated: [f, h] -> mlp.up_proj)
    decoder.layers.i.mlp.linear_fc2.*                 [h, f]         -> mlp.down_proj.*
    decoder.final_layernorm.*                                        -> model.norm.*
    output_layer.weight                               [V_padded, h]  -> lm_head.weight (untied only)

MoE layers (`config.moe.layer_flags[i]`; E experts, F expert ffn, Fs shared-expert ffn) replace
the two mlp.linear_fc tensors by:

    decoder.layers.i.mlp.router.weight                [E, h]         -> mlp.gate.weight
    decoder.layers.i.mlp.router.expert_bias           [E]            -> mlp.gate.expert_bias (DLM export only)
    decoder.layers.i.mlp.experts.linear_fc1.weight    [E, 2, F, h]   -> mlp.experts.{j}.gate_proj.weight ([j, 0]),
                                                                        mlp.experts.{j}.up_proj.weight ([j, 1])
        (not gated: [E, 1, F, h] -> mlp.experts.{j}.up_proj; biases [E, 2, F] alike)
    decoder.layers.i.mlp.experts.linear_fc2.weight    [E, h, F]      -> mlp.experts.{j}.down_proj.weight
        (bias [E, h] -> mlp.experts.{j}.down_proj.bias)
    decoder.layers.i.mlp.shared_experts.linear_fc1.*  [2, Fs, h]     -> mlp.shared_expert.{gate,up}_proj.*
    decoder.layers.i.mlp.shared_experts.linear_fc2.*  [h, Fs]        -> mlp.shared_expert.down_proj.*

Export writes the per-expert layout above (what transformers' save_pretrained writes, read by
4.x and 5.x alike); import also reads transformers 5's fused one, `mlp.experts.gate_up_proj`
[E, 2F, h] (gate rows, then up rows: our fc1 viewed as [E, 2F, h]) and `mlp.experts.down_proj`
[E, h, F] (our fc2 as it is).

Vocabulary tensors keep only the first V (unpadded) rows. Every tensor is checked against the
shape the config implies; a mismatch names the tensor and both shapes.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

Shape = Tuple[int, ...]
Reader = Callable[[str, Shape], torch.Tensor]
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


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


def is_moe_layer(config: TransformerConfig, index: int) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(index)


def has_fused_experts(names) -> bool:
    """Whether HF tensor names use transformers 5's fused expert layout (`mlp.experts.gate_up_proj`)."""
    return any(name.endswith(FUSED_EXPERTS[0]) for name in names)


def _linear(config: TransformerConfig, module: str) -> List[str]:
    return [f"{module}.weight"] + ([f"{module}.bias"] if config.add_bias_linear else [])


def _moe_names(config: TransformerConfig) -> List[str]:
    moe = config.moe
    names = ["mlp.router.weight"] + (["mlp.router.expert_bias"] if moe.router_enable_expert_bias else [])
    names += _linear(config, "mlp.experts.linear_fc1") + _linear(config, "mlp.experts.linear_fc2")
    if moe.shared_expert_intermediate_size:
        names += _linear(config, "mlp.shared_experts.linear_fc1") + _linear(config, "mlp.shared_experts.linear_fc2")
    return names


def layer_names(config: TransformerConfig, index: int) -> List[str]:
    """Our tensor names of layer `index` (relative to `decoder.layers.i.`) for this architecture."""
    names = [f"input_layernorm.{p}" for p in _norm_params(config)]
    names += [f"pre_mlp_layernorm.{p}" for p in _norm_params(config)]
    names.append("self_attention.linear_qkv.weight")
    if config.add_bias_linear or config.add_qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if config.qk_layernorm:
        names += [f"self_attention.{which}_layernorm.{p}" for which in "qk" for p in _norm_params(config)]
    names += _linear(config, "self_attention.linear_proj")
    if is_moe_layer(config, index):
        return names + _moe_names(config)
    return names + _linear(config, "mlp.linear_fc1") + _linear(config, "mlp.linear_fc2")


def global_names(config: TransformerConfig) -> List[str]:
    names = ["embedding.word_embeddings.weight"] + [f"decoder.final_layernorm.{p}" for p in _norm_params(config)]
    if config.position_embedding_type == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    if not config.share_embeddings_and_output_weights:
        names.append("output_layer.weight")
    return names


def _mlp_shape(config: TransformerConfig, name: str, ffn: int, halves_always: bool = False) -> Shape:
    """fc1 / fc2 of one MLP of inner width `ffn` (experts keep the halves dim when not gated)."""
    hidden, weight = config.hidden_size, name.endswith(".weight")
    if "linear_fc1" in name:
        rows = (2, ffn) if config.gated_linear_unit else ((1, ffn) if halves_always else (ffn,))
        return (*rows, hidden) if weight else rows
    return (hidden, ffn) if weight else (hidden,)


def _moe_shape(config: TransformerConfig, name: str) -> Shape:
    moe = config.moe
    if name.startswith("mlp.router."):
        return (moe.num_experts, config.hidden_size) if name.endswith(".weight") else (moe.num_experts,)
    if name.startswith("mlp.shared_experts."):
        return _mlp_shape(config, name, moe.shared_expert_intermediate_size)
    return (moe.num_experts, *_mlp_shape(config, name, moe.expert_ffn_size(config.ffn_hidden_size), True))


def our_shape(config: TransformerConfig, name: str) -> Shape:
    """The global shape of one of our per-layer tensors (name relative to the layer)."""
    groups, per_group, dim, hidden, ffn, heads = _dims(config)
    param = name.rsplit(".", 1)[1]
    if name.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts.")):
        return _moe_shape(config, name)
    if "layernorm" in name:
        if not name.startswith("self_attention."):
            return (hidden,)
        if config.qk_layernorm_scope == "all":
            return (heads * dim,) if name.startswith("self_attention.q_") else (groups * dim,)
        return (dim,)
    if "linear_qkv" in name:
        return (groups, per_group + 2, dim, hidden) if param == "weight" else (groups, per_group + 2, dim)
    if "linear_proj" in name:
        return (hidden, heads * dim) if param == "weight" else (hidden,)
    if "linear_fc" in name:
        return _mlp_shape(config, name, ffn)
    raise KeyError(name)


# ---------------------------------------------------------------------- per layer
_RENAMES = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
            "self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm",
            "self_attention.linear_proj": "self_attn.o_proj", "mlp.router": "mlp.gate"}
_MLP_PREFIXES = {"mlp": "mlp.", "mlp.shared_experts": "mlp.shared_expert."}


def _mlp_to_hf(gated: bool, which: str, param: str, tensor: torch.Tensor, prefix: str) -> Dict[str, torch.Tensor]:
    """One MLP's fc1 ([2, f, ...]; [f, ...] not gated) or fc2 -> gate_proj / up_proj / down_proj under `prefix`."""
    if which == "linear_fc2":
        return {f"{prefix}down_proj.{param}": tensor}
    if gated:
        return {f"{prefix}gate_proj.{param}": tensor[0], f"{prefix}up_proj.{param}": tensor[1]}
    return {f"{prefix}up_proj.{param}": tensor}


def _mlp_from_hf(gated: bool, which: str, param: str, read: Reader, prefix: str, shape: Shape) -> torch.Tensor:
    """The inverse of `_mlp_to_hf`; `shape` is our tensor's."""
    if which == "linear_fc2":
        return read(f"{prefix}down_proj.{param}", shape)
    if gated:
        return torch.stack([read(f"{prefix}gate_proj.{param}", shape[1:]), read(f"{prefix}up_proj.{param}", shape[1:])])
    return read(f"{prefix}up_proj.{param}", shape)


def _qkv_to_hf(config: TransformerConfig, param: str, tensor: torch.Tensor, prefix: str) -> Dict[str, torch.Tensor]:
    groups, per_group, dim, _, _, heads = _dims(config)
    tail = tensor.shape[3:]
    return {f"{prefix}self_attn.q_proj.{param}": tensor[:, :per_group].reshape(heads * dim, *tail),
            f"{prefix}self_attn.k_proj.{param}": tensor[:, per_group].reshape(groups * dim, *tail),
            f"{prefix}self_attn.v_proj.{param}": tensor[:, per_group + 1].reshape(groups * dim, *tail)}


def _qkv_from_hf(config: TransformerConfig, param: str, read: Reader, shape: Shape) -> torch.Tensor:
    groups, per_group, dim, _, _, heads = _dims(config)
    tail = shape[3:]
    query = read(f"self_attn.q_proj.{param}", (heads * dim, *tail)).reshape(groups, per_group, dim, *tail)
    key = read(f"self_attn.k_proj.{param}", (groups * dim, *tail)).reshape(groups, 1, dim, *tail)
    value = read(f"self_attn.v_proj.{param}", (groups * dim, *tail)).reshape(groups, 1, dim, *tail)
    return torch.cat([query, key, value], dim=1)


def _experts_to_hf(config: TransformerConfig, which: str, param: str, tensor: torch.Tensor,
                   prefix: str) -> Dict[str, torch.Tensor]:
    """Expert e's slice of [E, ...] -> mlp.experts.{e}.*, the per-expert layout save_pretrained writes."""
    hf = {}
    for expert in range(tensor.shape[0]):
        piece = tensor[expert] if which == "linear_fc2" or config.gated_linear_unit else tensor[expert, 0]
        hf.update(_mlp_to_hf(config.gated_linear_unit, which, param, piece, f"{prefix}mlp.experts.{expert}."))
    return hf


def _experts_from_hf(config: TransformerConfig, which: str, param: str, read: Reader, shape: Shape,
                     fused: bool) -> torch.Tensor:
    """Our [E, ...] expert tensor from the per-expert layout or transformers 5's fused one."""
    experts, per_expert = shape[0], shape[1:]
    if fused:
        if param != "weight":
            raise ValueError(f"expert biases (mlp.experts.*.{param}) in transformers' fused expert layout are not "
                             "supported; save the model with the per-expert layout (save_pretrained's default)")
        if which == "linear_fc2":
            return read(FUSED_EXPERTS[1], shape)
        return read(FUSED_EXPERTS[0], (experts, per_expert[0] * per_expert[1], per_expert[2])).view(shape)
    gated, pieces = config.gated_linear_unit, []
    for expert in range(experts):
        one = per_expert if which == "linear_fc2" or gated else per_expert[1:]
        piece = _mlp_from_hf(gated, which, param, read, f"mlp.experts.{expert}.", one)
        pieces.append(piece if which == "linear_fc2" or gated else piece.unsqueeze(0))
    return torch.stack(pieces)


def _norm_to_hf(config: TransformerConfig, module: str, param: str, tensor: torch.Tensor) -> torch.Tensor:
    """HF norms multiply by their weight: a zero-centred scale (--apply-layernorm-1p) exports as 1 + w."""
    if config.layernorm_zero_centered_gamma and module.endswith("layernorm") and param == "weight":
        return tensor + 1.0
    return tensor


def layer_to_hf(config: TransformerConfig, index: int, ours: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One layer's tensors (our names relative to `decoder.layers.i.`) -> HF names."""
    prefix = f"model.layers.{index}."
    hf = {}
    for name in layer_names(config, index):
        tensor = ours[name]
        check_shape(f"decoder.layers.{index}.{name}", tensor, our_shape(config, name), "checkpoint")
        module, param = name.rsplit(".", 1)
        owner, _, which = module.rpartition(".")
        if module == "self_attention.linear_qkv":
            hf.update(_qkv_to_hf(config, param, tensor, prefix))
        elif owner == "mlp.experts":
            hf.update(_experts_to_hf(config, which, param, tensor, prefix))
        elif module in _RENAMES:
            hf[f"{prefix}{_RENAMES[module]}.{param}"] = _norm_to_hf(config, module, param, tensor)
        else:  # a dense MLP or the shared expert
            hf.update(_mlp_to_hf(config.gated_linear_unit, which, param, tensor, prefix + _MLP_PREFIXES[owner]))
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def layer_from_hf(config: TransformerConfig, index: int, get: Callable[[str], torch.Tensor],
                  fused_experts: bool = False) -> Dict[str, torch.Tensor]:
    """One layer's HF tensors (read with `get(hf_name)`) -> our names relative to `decoder.layers.i.`.
    `fused_experts`: the MoE layers are in transformers 5's fused layout (`has_fused_experts`)."""
    prefix = f"model.layers.{index}."

    def read(hf_name: str, shape: Shape) -> torch.Tensor:
        tensor = get(prefix + hf_name)
        check_shape(prefix + hf_name, tensor, shape, "Hugging Face checkpoint")
        return tensor

    ours = {}
    for name in layer_names(config, index):
        module, param = name.rsplit(".", 1)
        owner, _, which = module.rpartition(".")
        shape = our_shape(config, name)
        if module == "self_attention.linear_qkv":
            ours[name] = _qkv_from_hf(config, param, read, shape)
        elif owner == "mlp.experts":
            ours[name] = _experts_from_hf(config, which, param, read, shape, fused_experts)
        elif module in _RENAMES:
            ours[name] = read(f"{_RENAMES[module]}.{param}", shape)
        else:  # a dense MLP or the shared expert
            ours[name] = _mlp_from_hf(config.gated_linear_unit, which, param, read, _MLP_PREFIXES[owner], shape)
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
        hf[f"model.norm.{param}"] = _norm_to_hf(config, "final_layernorm", param, tensor)
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


def hf_names(config: TransformerConfig, fused_experts: bool = False) -> List[str]:
    """Every HF tensor name of this architecture (what an export writes, what an import reads);
    `fused_experts`: the MoE layers in transformers 5's fused layout instead of per expert."""
    names = ["model.embed_tokens.weight"] + [f"model.norm.{p}" for p in _norm_params(config)]
    if not config.share_embeddings_and_output_weights:
        names.append("lm_head.weight")
    for index in range(config.num_layers):
        fake = {name: torch.empty(our_shape(config, name), device="meta") for name in layer_names(config, index)}
        layer = list(layer_to_hf(config, index, fake))
        if fused_experts and is_moe_layer(config, index):
            prefix = f"model.layers.{index}."
            layer = [name for name in layer if not _PER_EXPERT.search(name)] + [prefix + n for n in FUSED_EXPERTS]
        names += layer
    return names
