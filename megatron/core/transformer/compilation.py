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

Training with variable lengths (--difflm-varilen-prob) marks the sequence dimension of the layers'
inputs dynamic from the first step (`variable_length`, a pre-hook on each TransformerBlock). Left to
dynamo's default, the layer is compiled for the full length, and the first truncated micro-batch
recompiles it, forward and backward, with a symbolic length mid-run: a stall of about 10 s on an H100
for the 1.7B model at whatever step the first cut falls (iteration 13 of a global batch of 8 at the
default seed), after which that symbolic graph serves every length anyway. Only that dimension:
`dynamic=True` would also make the batch, the float attributes and any size equal to the length
symbolic (dynamo gives equal sizes one symbol, and a hidden size equal to the length then
specialises both).

A symbolic length alone is not enough on a GPU: Inductor's mix-order reduction (RMSNorm's backward
fusing the weight-gradient column sum with the row sums) decides by size thresholds evaluated on the
length's hint, and each decision is a guard: the 1.7B model compiled for 4096 tokens recompiled, forward
and backward, for lengths below 2560, again below 2048 and again below 1280 (2-6 s each, H100), until
dynamo's limit of 8 graphs sent later lengths to eager silently. `VARIABLE_LENGTH_INDUCTOR_OPTIONS`
turns those thresholds off for these compilations (non-strict mode fuses whenever the fusion is legal),
so one graph serves every length; at the full length it fuses as before.
"""

from __future__ import annotations

import torch
import torch._inductor.config
from torch import nn

from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import DLMConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


DYNAMIC_RECOMPILE_LIMIT = 32
# Inductor options of a variable-length training compilation (see the module docstring).
VARIABLE_LENGTH_INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def _variable_length_options(compile_options: dict) -> dict:
    """`compile_options` with VARIABLE_LENGTH_INDUCTOR_OPTIONS added to its Inductor options, those this
    torch has (the mix-order reduction arrived in torch 2.10)."""
    triton = torch._inductor.config.triton
    known = {key: value for key, value in VARIABLE_LENGTH_INDUCTOR_OPTIONS.items()
             if hasattr(triton, key.split(".", 1)[1])}
    return {**compile_options, "options": {**known, **compile_options.get("options", {})}}


def compile_transformer_layers(model: nn.Module, variable_length: bool = False, **compile_options) -> int:
    """`layer.compile(**compile_options)` for every TransformerLayer of `model`; returns how many.
    `variable_length`: the sequence length varies between calls (see the module docstring)."""
    if compile_options.get("dynamic"):
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, DYNAMIC_RECOMPILE_LIMIT)
    if variable_length and compile_options.get("backend", "inductor") == "inductor":
        compile_options = _variable_length_options(compile_options)
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    for layer in layers:
        layer.compile(**compile_options)
    if variable_length:
        for block in (module for module in model.modules() if isinstance(module, TransformerBlock)):
            block.register_forward_pre_hook(_mark_sequence_dynamic)
    return len(layers)


def _mark_sequence_dynamic(block: TransformerBlock, args: tuple) -> None:
    """Mark the sequence dimension of what the block's layers read ([s, b, h] hidden states, the [b, 1, s, d]
    rotary tables, the mask's per-position tensors) dynamic, before the layers' first compilation."""
    hidden, mask, rotary = (tuple(args) + (None, None, None))[:3]
    marks = [(hidden if hidden is not None else block.input_tensor, 0)]
    marks += [(table, 2) for table in rotary or ()]
    marks += [(getattr(mask, name, None), dim)
              for name, dim in (("document_ids", 1), ("query_positions", 0), ("key_positions", 0))]
    for tensor, dim in marks:
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def training_compile_options(dlm_config: DLMConfig) -> dict:
    """The training run's options for `compile_transformer_layers`: a dynamic sequence length from the
    first step when micro-batches are truncated to random lengths (see the module docstring)."""
    return {"variable_length": dlm_config.is_diffusion and dlm_config.varilen_prob > 0}
