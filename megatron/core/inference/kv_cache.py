"""The key/value cache of generation: per-layer buffers over canvas positions (`KVCache`) and each layer's
handle on them (`LayerCache`).

Like generation.py, this file imports only the standard library and torch: the Hugging Face exporter
copies it next to an exported ``modeling_dlm.py``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["KVCache", "LayerCache", "compiler_disabled"]


def compiler_disabled(fn: Callable) -> Callable:
    """`torch.compiler.disable(fn)` made at the first call (the decorator imports torch._dynamo, 1.5 s
    of start-up a run without torch.compile never needs); a first call inside a compiled region
    graph-breaks on the wrapping and runs `fn` eagerly, as the decorator would."""
    disabled = []
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call



class KVCache:
    """Per-layer key/value buffers ``[B, kv_heads, max_length, head_dim]`` over canvas positions.

    Buffers are allocated on a layer's first `update` with the incoming dtype and device, so
    the cache needs no knowledge of the model: ``num_layers`` may be None (any layer index).
    """

    def __init__(self, num_layers: Optional[int], max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"KVCache.max_length={max_length} must be positive")
        self.num_layers, self.max_length = num_layers, max_length
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        self.filled_length = 0
        """One past the highest position written so far (by any layer)."""

    def reset(self) -> None:
        self.keys.clear()
        self.values.clear()
        self.filled_length = 0

    def for_layer(self, layer: int) -> "LayerCache":
        """Layer `layer`'s handle: what a model hands each of its layers."""
        return LayerCache(self, layer)

    def update(self, layer: int, start, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``key``/``value`` ``[B, kv_heads, q, d]`` at ``[start, start + q)``; return the full buffers.

        ``start`` is an int, or the ``[q]`` integer tensor of the slots to write, on the buffers'
        device: that write needs no host value, so one captured CUDA graph serves every offset
        (the caller checks the slots; ``filled_length`` is not tracked)."""
        if key.dim() != 4 or key.shape != value.shape:
            raise ValueError(f"KVCache.update expects key and value [B, kv_heads, q, d] of one shape, got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        if self.num_layers is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"KVCache layer {layer} is outside [0, {self.num_layers})")
        length = key.shape[2]
        on_device = isinstance(start, torch.Tensor)
        if on_device and (start.shape != (length,) or start.dtype != torch.int64):
            raise ValueError(f"KVCache start must be an int or the [{length}] int64 tensor of the slots to write, "
                             f"got {tuple(start.shape)} {start.dtype}")
        if not on_device and (start < 0 or start + length > self.max_length):
            raise ValueError(f"KVCache positions [{start}, {start + length}) fall outside [0, {self.max_length})")
        if layer not in self.keys:
            # Zeros, not empty: unwritten slots are masked out, but 0 * NaN garbage in
            # probs @ V would still poison the output.
            shape = (key.shape[0], key.shape[1], self.max_length, key.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values[layer] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        keys, values = self.keys[layer], self.values[layer]
        if keys.shape[:2] != key.shape[:2] or keys.shape[3] != key.shape[3]:
            raise ValueError(f"KVCache layer {layer} holds [B, heads, _, d] = {tuple(keys.shape)} but got "
                             f"{tuple(key.shape)}; call reset() before reusing the cache for another batch")
        if on_device:
            keys.index_copy_(2, start, key.to(keys.dtype))
            values.index_copy_(2, start, value.to(values.dtype))
            return keys, values
        keys[:, :, start:start + length] = key.to(keys.dtype)
        values[:, :, start:start + length] = value.to(values.dtype)
        self.filled_length = max(self.filled_length, start + length)
        return keys, values


class LayerCache:
    """One layer's view of a `KVCache`: ``update(start, key, value) -> (keys, values)``.

    Its update runs eagerly inside a torch.compile'd layer. Traced, the cache's dict of
    buffers and the Python ints (layer index, offsets) would become guards: a recompilation
    per layer and per offset. Opaque, every layer shares one compiled graph before the update
    and one after it."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    @compiler_disabled
    def update(self, start, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.layer, start, key, value)
