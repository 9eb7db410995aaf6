"""A stack of transformer layers: the whole decoder or one pipeline stage's slice of it.

Layers live in a ModuleDict keyed by their global index, so a checkpoint key such as
`decoder.layers.17.mlp.linear_fc1.weight` is the same whatever the pipeline layout.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from megatron.core.tensor_parallel import checkpoint_with_tracker

from megatron.core.parallel_state import ProcessGroups
from megatron.core.transformer.attention import RotaryPair
from megatron.core.transformer.attention_mask import AttentionMask, build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import DiffLMTransformerLayer, TransformerLayer

LayerBuilder = Callable[[int], TransformerLayer]


class TransformerBlock(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_range: Optional[Tuple[int, int]] = None,
                 post_layer_norm: bool = True, layer_builder: Optional[LayerBuilder] = None,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config)
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer_range={layer_range} must satisfy 0 <= start < end <= "
                             f"num_layers={config.num_layers}")
        self.layer_range = (start, end)
        build = layer_builder or (lambda number: TransformerLayer(config, number, pg=pg))
        self.layers = nn.ModuleDict({str(number): build(number) for number in range(start, end)})
        self.final_layernorm = build_norm(config, config.hidden_size) if post_layer_norm else None
        self.input_tensor: Optional[torch.Tensor] = None
        self.rng_tracker = getattr(pg, "rng_tracker", None)
        """With tensor parallelism (a ParallelContext from GPTModel): full recompute replays the
        tracker's dropout streams too."""

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = input_tensor

    def _recompute_groups(self) -> List[Tuple[List[TransformerLayer], bool]]:
        """Split the local layers into runs, each flagged whether it is recomputed as one piece."""
        layers = list(self.layers.values())
        cfg = self.config
        if cfg.recompute_granularity != "full":
            return [([layer], False) for layer in layers]
        if cfg.recompute_method == "uniform":
            # Checkpoint only the input of every group of N layers: least memory, most recompute.
            size = cfg.recompute_num_layers
            return [(layers[i:i + size], True) for i in range(0, len(layers), size)]
        # "block": the first N layers of this stage are recomputed one by one, the rest are not.
        return [([layer], index < cfg.recompute_num_layers) for index, layer in enumerate(layers)]

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask: AttentionMask,
                rotary_pos_emb: Optional[RotaryPair] = None, kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        """``kv_cache`` / ``cache_start``: generation only; each layer gets its own handle
        (`kv_cache.for_layer(layer_number)`, see `SelfAttention.forward`)."""
        if hidden_states is None:
            hidden_states = self.input_tensor
        for group, recompute in self._recompute_groups():
            def run(x, group=group):
                for layer in group:
                    layer_cache = None if kv_cache is None else kv_cache.for_layer(layer.layer_number)
                    x = layer(x, attention_mask, rotary_pos_emb, kv_cache=layer_cache, cache_start=cache_start)
                return x
            if recompute and torch.is_grad_enabled():
                hidden_states = checkpoint_with_tracker(run, self.rng_tracker, hidden_states)
            else:
                hidden_states = run(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class DiffLMTransformerBlock(TransformerBlock):
    """The decoder of a diffusion LM: DiffLM layers and the running mode's attention mask.

    Callers may pass an explicit `AttentionMask`; otherwise the block builds the one of the
    DLM config (per-document when `document_ids` are given) once for all its layers.
    """

    def __init__(self, config: TransformerConfig, dlm_config: DLMConfig,
                 layer_range: Optional[Tuple[int, int]] = None, post_layer_norm: bool = True,
                 pg: Optional[ProcessGroups] = None) -> None:
        super().__init__(config, layer_range, post_layer_norm,
                         layer_builder=lambda number: DiffLMTransformerLayer(config, dlm_config, number, pg), pg=pg)
        self.dlm_config = dlm_config

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask: Optional[AttentionMask] = None,
                rotary_pos_emb: Optional[RotaryPair] = None,
                document_ids: Optional[torch.Tensor] = None, kv_cache=None, cache_start: int = 0) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = build_attention_mask(self.config, self.dlm_config, document_ids)
        return super().forward(hidden_states, attention_mask, rotary_pos_emb, kv_cache, cache_start)
