"""FP8 training of the transformer layers' linear layers, through torchao's float8 (one seam).

`--fp8-format {e4m3,hybrid}` picks the element type of the gradients (hybrid: e4m3 forward,
e5m2 for the output gradients, Megatron's meaning); `--fp8-recipe {tensorwise,rowwise}` picks
torchao's scaling (one dynamic scale per tensor, or per row). Weights stay fp32 masters;
only the GEMMs run in fp8. Attention stays in bf16; the output layer too, unless
`--fp8-output-layer` puts its logits and input-gradient GEMMs in float8 (the chunked loss's own
casts, fp8/float8_matmul.py).

torchao converts `nn.Linear` modules, so single-rank tensor-parallel linears are first replaced
by `nn.Linear` modules that share their parameters (the same computation at tp=1): parameter
names, checkpoints and optimizer groups do not change. Transformer Engine is the other backend
Megatron users know; it is not installable on our machines, so it is not wired in.
Apply before `torch.compile` (the compiler then fuses fp8 casts into neighbouring kernels)
and before the data-parallel wrappers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise")
TORCHAO_MISSING = "FP8 training needs torchao's float8 training: pip install torchao (or the 'kernels' extra)"


def _as_linear(layer: nn.Module) -> nn.Linear:
    if layer.tp_size != 1 or layer.sequence_parallel:
        raise ValueError("--fp8-format supports --tensor-model-parallel-size 1 for now (torchao converts "
                         "nn.Linear); drop --fp8-format or tensor parallelism")
    linear = nn.Linear(layer.input_size, layer.output_size, bias=layer.bias is not None, device="meta")
    linear.weight, linear.bias = layer.weight, layer.bias
    return linear


def swap_parallel_linears(module: nn.Module) -> int:
    """Single-rank Column/RowParallelLinear children of `module` replaced by parameter-sharing
    `nn.Linear`s; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                setattr(parent, name, _as_linear(child))
                swapped += 1
    return swapped


def float8_config(fp8_format: str = "hybrid", recipe: str = "tensorwise"):
    """torchao's Float8LinearConfig for a recipe, with the gradient element type of the format."""
    if fp8_format not in FP8_FORMATS or recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-format {fp8_format!r} / --fp8-recipe {recipe!r}: choose a format from "
                         f"{FP8_FORMATS} and a recipe from {FP8_RECIPES}")
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as error:
        raise ImportError(TORCHAO_MISSING) from error
    config = Float8LinearConfig.from_recipe_name(recipe)
    gradient_dtype = torch.float8_e5m2 if fp8_format == "hybrid" else torch.float8_e4m3fn
    changes = {name: dataclasses.replace(getattr(config, name), target_dtype=gradient_dtype)
               for name in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
               if getattr(config, name) is not None}
    return dataclasses.replace(config, **changes)


def float8_gemms_on_cpu(device: torch.device) -> None:
    """Float8 GEMMs on a CPU (tests, the quickstart) through torch's own `_scaled_mm` kernel, which
    widens the operands and runs its ordinary GEMM: oneDNN's float8 matmul, which torch takes on CPUs
    with AMX tiles, is oneDNN's reference loop there (about 1 s for one [1024, 128] x [128, 384]
    product on a Sapphire Rapids core, 3 ms through torch's kernel, the same bits). This turns oneDNN
    off for the process, so call it only where float8 GEMMs run on the CPU."""
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        torch.backends.mkldnn.enabled = False


def enable_fp8_training(model: nn.Module, fp8_format: str = "hybrid", recipe: str = "tensorwise") -> int:
    """The decoder's linear layers (dims divisible by 16, as fp8 GEMMs need) trained in fp8;
    returns how many were converted."""
    config = float8_config(fp8_format, recipe)
    from torchao.float8 import convert_to_float8_training

    swap_parallel_linears(model.decoder)

    def eligible(module: nn.Module, name: str) -> bool:
        return name.startswith("decoder.") and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return sum(type(module).__name__ == "Float8Linear" for module in model.modules())
