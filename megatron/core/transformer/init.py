"""How weights are initialised, shared by every layer that owns weights.

Every weight is drawn whole from a seed of its own and then sliced by the tensor-parallel
layers (`tensor_parallel.init_master_weight`), so any layout starts from exactly the weights of
the single-process model.
"""

from __future__ import annotations

import hashlib
import math

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


def parameter_seed(layer_number: int, name: str) -> int:
    """Seed of one weight's init: the run's seed (torch.manual_seed) and the weight's identity."""
    text = f"{torch.initial_seed()}:{layer_number}:{name}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def output_init_std(config: TransformerConfig) -> float:
    """Projections that write into the residual stream are scaled by 1/sqrt(2 * layers)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)
