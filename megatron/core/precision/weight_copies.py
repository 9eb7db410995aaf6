"""Low-precision working copies of the linear layers' fp32 weights (`--cache-low-precision-weights`).

Under bf16 autocast with fp32 master weights every forward of every micro-batch casts each
linear weight to bf16: a read of 4 and a write of 2 bytes a parameter (the compiler fuses the
cast into a neighbouring kernel, but the bytes stay), about 2 ms a step at the Qwen3-1.7B shape on
an H200. Megatron keeps bf16 parameters and fp32 main weights in the optimizer instead; here the
fp32 parameters stay (checkpoints, data-parallel buffers and the optimizer are unchanged) and each
tensor-parallel linear layer's GEMM becomes a `working_copy.CopyGemm` holding a copy in the compute
dtype that its training forward reads instead of casting. The weight gradient
still reaches the fp32 weight, computed in fp32. Under the masked-only loss the output layer's
weight (the word embedding's, when tied) gets one too, in the compute dtype even under fp8, which
the chunked loss reads instead of casting it (`linear_cross_entropy(weight_low=...)`, through the
owner's `gemm.working_copy()`).

Freshness: `WeightCopies.refresh` (the trainer calls it before each iteration's forwards) re-casts
every copy that the optimizer did not write in the step since the last refresh, and every copy
whose weight changed after it was written (its version counter or storage moved: a loaded
checkpoint, a hand edit). A `CompiledAdamW` handed the copies writes them in its update kernel
(2 more bytes a parameter in a pass that already reads and writes the weight); any other
optimizer, and ZeRO-1's broadcast of the other ranks' shards (collectives do not move version
counters), leave them to the refresh, which then costs one cast a step instead of one per
micro-batch. Evaluation (`module.eval()`) always casts, so no copy is read outside training.

Under `--fp8-format` (which turns the copies on itself) the copies are float8 instead
(fp8/float8_copy.py's `Float8Gemm`): each decoder linear layer whose dimensions are multiples of 16
keeps its weight in e4m3 twice (row-major for the forward GEMM and transposed for the input gradient's)
with the inverse scale, and runs its GEMMs in float8 itself (`float8_matmul.float8_linear`) instead of
casting the fp32 weight in every micro-batch's forward (and transposing it in the backward). The refresh
casts every float8 copy once an iteration with the weight's own amax (current scaling, whatever wrote
the weight), so a ZeRO-1 rank, a resumed run and an uninterrupted one hold the same values. The
optimizer does not write them: a write in its update kernel would have to scale by an amax from before
the update (measured at the 7B width, docs/performance_history.md: it did not pay). In evaluation the
weight is cast afresh. With `--fp8-recipe delayed` the layers' inputs and output gradients are cast by
delayed scales (`WeightCopies.delayed_scaling`, float8_scaling.py; the trainer calls `end_iteration`
after each optimizer step, and a checkpoint saves `state_dict`); the weights keep their own amax. Under
tensor or context parallelism each rank casts what its GEMMs read: its weight shard by the shard's amax,
and under the tensorwise recipe a row-parallel layer's input shard, a column-parallel layer's
output-gradient shard and its sequence chunk by their own (no collective; each product is scaled back
before the layers' reductions), so the values differ from one GPU's within float8's rounding only
(tests/distributed/test_weight_copies_parallel.py). Delayed scaling's amaxes are the largest over the
data-parallel, context-parallel and tensor-parallel ranks (Megatron's amax reduction group): every rank
of a layer casts by the same scales, those of the whole tensor.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from megatron.core.fp8.float8_copy import Float8Copy, Float8Gemm, cast_float8
from megatron.core.fp8.float8_matmul import ALIGNMENT, GRADIENT_DTYPES
from megatron.core.fp8.float8_mlp import swiglu_mlp
from megatron.core.fp8.float8_scaling import DelayedScaling, DelayedScalingConfig
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.precision.working_copy import CopyGemm
from megatron.core.tensor_parallel.fp32_weight_grad import GemmLayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP


def _output_weight_owners(model: nn.Module) -> Dict[int, bool]:
    """{id of a module holding an output layer's weight: whether its loss reads a working copy}. The
    masked-only loss does (`linear_cross_entropy(weight_low=...)` instead of its cast); the full-logits
    loss casts under autocast, and an untied output layer's own forward never runs."""
    owners = {}
    for module in model.modules():
        if isinstance(module, GPTModel) and module.post_process:
            owners[id(module.output_weight_owner())] = module.dlm_config.masked_only_loss
    return owners


class WeightCopies:
    """The compute-dtype copies of `model`'s tensor-parallel linear weights (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, fp8_format: Optional[str] = None,
                 delayed: Optional[DelayedScalingConfig] = None, groups: Sequence = ()) -> None:
        self.dtype = dtype
        self.layers: List[Tuple[nn.Module, Union[torch.Tensor, Float8Copy]]] = []
        heads = _output_weight_owners(model)
        for module in model.modules():
            if not isinstance(module, GemmLayer) or module.weight.dtype != torch.float32:
                continue
            weight = module.weight
            if id(module) in heads:
                if heads[id(module)]:  # read by the chunked loss in the compute dtype, float8 or not
                    self.layers.append((module, self._new_copy(module, weight, None)))
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                self.layers.append((module, self._new_copy(module, weight, fp8_format)))
        for module in model.modules():  # two float8 layers of a SwiGLU MLP run as one function (float8_mlp.py)
            if isinstance(module, MLP) and all(isinstance(layer.gemm, Float8Gemm)
                                               for layer in (module.linear_fc1, module.linear_fc2)):
                module.fused_forward = swiglu_mlp
        self._index: Dict[int, int] = {}
        self._written: Dict[int, tuple] = {}
        """Copies the optimizer wrote since the last refresh: index -> the weight's stamp then."""
        self.delayed_scaling: Optional[DelayedScaling] = None
        """`--fp8-recipe delayed`: the float8 layers' amax histories and scales (float8_scaling.py)."""
        if delayed is not None and fp8_format is not None:
            names = {id(module): name for name, module in model.named_modules()}
            float8 = [module for module, copy in self.layers if isinstance(copy, Float8Copy)]
            self.delayed_scaling = DelayedScaling([module.gemm for module in float8], [names[id(m)] for m in float8],
                                                  fp8_format, delayed, groups)
        self.refresh()

    def end_iteration(self, skipped: bool = False) -> None:
        """After the optimizer step: delayed scaling takes the iteration's amaxes (float8_scaling.py)."""
        if self.delayed_scaling is not None:
            self.delayed_scaling.update(skipped)

    def _new_copy(self, module: GemmLayer, weight: torch.Tensor, fp8_format: Optional[str]):
        """Swap `module`'s GEMM for one reading a copy of `weight` (float8 under `fp8_format` where its
        dimensions allow); returns the copy."""
        fp32_weight_grad = module.gemm.fp32_weight_grad
        if fp8_format is not None and all(size % ALIGNMENT == 0 for size in weight.shape):
            module.gemm = Float8Gemm(weight, GRADIENT_DTYPES[fp8_format], fp32_weight_grad)
            return module.gemm.stored_copy()
        module.gemm = CopyGemm(torch.empty_like(weight, dtype=self.dtype), fp32_weight_grad)
        return module.gemm.copy

    @property
    def has_state(self) -> bool:
        """Whether a checkpoint keeps some of theirs (`state_dict` is not None)."""
        return self.delayed_scaling is not None

    def state_dict(self) -> Optional[Dict[str, object]]:
        """What a checkpoint keeps of them (`--fp8-recipe delayed`'s histories and scales), or None."""
        return self.delayed_scaling.state_dict() if self.has_state else None

    def load_state_dict(self, state: Dict[str, object]) -> Optional[str]:
        """Restore `state_dict`'s; None, or why it does not fit this run (which then starts afresh)."""
        if not self.has_state:
            return "this run does not use --fp8-recipe delayed"
        return self.delayed_scaling.load_state_dict(state)

    @property
    def float8_layers(self) -> int:
        """How many layers run their GEMMs in float8 from float8 copies."""
        return sum(isinstance(copy, Float8Copy) for _, copy in self.layers)

    @property
    def pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(weight, copy) of every layer, the weight read live (a loader may assign a new parameter)."""
        return [(module.weight, copy) for module, copy in self.layers]

    @staticmethod
    def _stamp(weight: torch.Tensor) -> tuple:
        return id(weight), weight._version, weight.data_ptr()

    def refresh(self) -> int:
        """Re-cast every copy not written by the optimizer since the last refresh, or whose weight
        changed after it was; returns how many."""
        pairs = self.pairs
        stale = [index for index, (weight, _) in enumerate(pairs) if self._written.get(index) != self._stamp(weight)]
        plain = [index for index in stale if not isinstance(pairs[index][1], Float8Copy)]
        with torch.no_grad():
            if plain:
                torch._foreach_copy_([pairs[i][1] for i in plain], [pairs[i][0].detach() for i in plain])
        float8 = [index for index in stale if index not in plain]
        cast_float8([pairs[index][1] for index in float8], [pairs[index][0] for index in float8])
        self._written.clear()
        self._index = {id(weight): index for index, (weight, _) in enumerate(pairs)}
        return len(stale)

    def copy_of(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The copy of `weight`, for an optimizer that writes it with the update; None if it has none or
        a float8 one (the refresh casts those)."""
        index = self._index.get(id(weight))
        copy = None if index is None else self.layers[index][1]
        return None if isinstance(copy, Float8Copy) else copy

    def written(self, weights: List[torch.Tensor]) -> None:
        """The optimizer wrote these weights' copies with their new values."""
        for weight in weights:
            index = self._index.get(id(weight))
            if index is not None:
                self._written[index] = self._stamp(weight)
