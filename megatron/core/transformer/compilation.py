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
"""

from __future__ import annotations

from torch import nn

from megatron.core.transformer.transformer_layer import TransformerLayer


def compile_transformer_layers(model: nn.Module, **compile_options) -> int:
    """`layer.compile(**compile_options)` for every TransformerLayer of `model`; returns how many."""
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    for layer in layers:
        layer.compile(**compile_options)
    return len(layers)
