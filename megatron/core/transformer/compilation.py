"""torch.compile applied to a model's transformer layers, in place.

The layer is the unit: every layer has the same code and shapes, so (with torch's default
inlining of nn.Module calls, which guards on parameter shapes rather than module identity)
one compiled graph serves all of them, and the data-dependent parts around the decoder
(embedding, masked-only loss, corruption) stay eager. `module.compile()` keeps the module
object and its parameter names, so checkpoints, sharded state dicts and the data-parallel
wrappers see the same model.

Order: compile before wrapping for data parallelism (DDP / FSDP2 then hook the compiled
layers like any other), after any module swaps (fp8). Activation recompute composes: full
recompute checkpoints the compiled layer call and replays it; selective recompute's
checkpoint inside the layer is traced by the compiler.

Generation compiles with `dynamic=True` and runs the layers at many shapes: batch 1 and more,
one token and more, with and without a KV cache. Dynamo still specialises sizes 0 and 1, so
those combinations can pass its default of 8 graphs per code object, after which it silently
runs the layer eagerly (2.3x slower at batch 1 for Qwen3-1.7B). Dynamic compilation therefore
raises that limit to `DYNAMIC_RECOMPILE_LIMIT`.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.transformer.transformer_layer import TransformerLayer


DYNAMIC_RECOMPILE_LIMIT = 32


def compile_transformer_layers(model: nn.Module, **compile_options) -> int:
    """`layer.compile(**compile_options)` for every TransformerLayer of `model`; returns how many."""
    if compile_options.get("dynamic"):
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, DYNAMIC_RECOMPILE_LIMIT)
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    for layer in layers:
        layer.compile(**compile_options)
    return len(layers)
