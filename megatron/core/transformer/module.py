"""MegatronModule: the base class of every model component."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Dict, Optional

import torch
from torch import nn

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(nn.Module):
    """Holds the config and describes its state as layout-independent shards.

    `sharded_state_dict()` is the seam the checkpoint code uses: plain modules describe
    their parameters as whole tensors; tensor-parallel layers override it to give their
    slice of the global tensor.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        return collect_sharded_state_dict(self, prefix)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Pipeline stages after the first receive their input here (overridden where used)."""
        raise NotImplementedError(f"{type(self).__name__} is not a pipeline stage entry point")

    def _autocast(self, device: torch.device) -> ContextManager:
        """Mixed-precision compute (--bf16 / --fp16) over the fp32 master weights; a no-op in fp32.
        Here, not in GPTModel, because the output layer enters it as well as the decoder."""
        if self.config.bf16 or self.config.fp16:
            return torch.autocast(device.type, dtype=self.config.compute_dtype)
        return nullcontext()


def collect_sharded_state_dict(module: nn.Module, prefix: str = "") -> Dict[str, ShardedTensor]:
    """Own parameters and persistent buffers as whole tensors, children by their own
    `sharded_state_dict` (tensor-parallel layers describe their slices), containers such as
    ModuleDict recursively."""
    sharded: Dict[str, ShardedTensor] = {}
    own = list(module.named_parameters(recurse=False)) + [
        (name, buf) for name, buf in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set]
    for name, tensor in own:
        key = f"{prefix}{name}"
        sharded[key] = ShardedTensor.from_local(key, tensor)
    for name, child in module.named_children():
        child_prefix = f"{prefix}{name}."
        describe = getattr(child, "sharded_state_dict", None)
        sharded.update(describe(child_prefix) if describe is not None
                       else collect_sharded_state_dict(child, child_prefix))
    return sharded
