"""The routed experts of one MoE layer: 3-D weights and one grouped GEMM over all local experts.

Weights use Hugging Face's fused layout (transformers 5): `linear_fc1.weight [E, 2F, h]` (gate
rows, then up rows, for a gated MLP; `[E, F, h]` otherwise) and `linear_fc2.weight [E, h, F]`.
Under expert parallelism a rank holds `E / ep` consecutive experts; under expert tensor
parallelism each expert's inner dim F is split over the etp ranks (fc1 by rows of gate and of up,
as the dense MLP splits them; fc2 by columns), and the rank's fc2 output is a partial sum that
the dispatcher adds up over the etp ranks. Every expert's weights are drawn from a seed of their
own, so any layout starts from the single-process weights; the checkpoint stores global `[E, ...]`
tensors, so any layout loads them.

Tokens arrive sorted by local expert with their counts. `grouped_gemm` runs each projection as one
`torch.nn.functional.grouped_mm` (CUDA, bf16); elsewhere one GEMM per expert gives the same
numbers. Gradients of expert weights are summed over the expert-data-parallel replicas, not the
dense ones (parameters are tagged `expert_parallel`; data_parallel.py).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import init_master_weight
from megatron.core.transformer.init import output_init_std, parameter_seed
from megatron.core.fusions import fused_swiglu
from megatron.core.transformer.mlp import activate
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def _grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """`x [N, in]` sorted by expert (`counts[e]` rows each, a device tensor) times `weight[e] [out, in]`^T
    -> `[N, out]`: one grouped GEMM where asked for and it runs (CUDA, bf16), else one GEMM per expert."""
    if grouped and _grouped_mm_available(x):
        return grouped_mm_linear(x, weight, counts)
    return looped_linear(x, weight, counts)


def grouped_mm_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one torch grouped_mm, which reads the experts' offsets on the device."""
    grouped_mm = getattr(nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(x, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))


def looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one GEMM per expert, which needs the counts on the host (one sync)."""
    # unbind: one view per expert, so backward writes each expert's gradient once (indexing
    # weight[e] would add a zero-filled gradient of the whole tensor per expert).
    pieces = [nn.functional.linear(chunk, w) for chunk, w in zip(x.split(counts.tolist()), weight.unbind(0))]
    return torch.cat(pieces) if pieces else x.new_zeros((0, weight.shape[1]))


def _tag(param: nn.Parameter) -> nn.Parameter:
    param.expert_parallel = True
    param.tensor_model_parallel = False
    param.partition_dim = None
    return param


class GroupedExperts(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int = 0, ep_rank: int = 0, ep_size: int = 1,
                 etp_rank: int = 0, etp_size: int = 1, edp_rank: int = 0) -> None:
        super().__init__(config)
        fused_swiglu.register_for(config)
        moe = config.moe
        self.num_experts, self.num_local_experts = moe.num_experts, moe.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.ffn = moe.expert_ffn_size(config.ffn_hidden_size)
        self.local_ffn = self.ffn // etp_size
        self.gated, self.grouped = config.gated_linear_unit, moe.grouped_gemm
        self.etp_rank, self.etp_size, self.edp_rank = etp_rank, etp_size, edp_rank
        halves, hidden = (2 if self.gated else 1), config.hidden_size
        fc1, fc2 = [], []
        for expert in range(self.first_expert, self.first_expert + self.num_local_experts):
            master1 = init_master_weight((halves, self.ffn, hidden), config.init_method_std,
                                         parameter_seed(layer_number, f"experts.{expert}.linear_fc1"),
                                         config.params_dtype)
            master2 = init_master_weight((hidden, self.ffn), output_init_std(config),
                                         parameter_seed(layer_number, f"experts.{expert}.linear_fc2"),
                                         config.params_dtype)
            rows = slice(etp_rank * self.local_ffn, (etp_rank + 1) * self.local_ffn)
            fc1.append(master1[:, rows].reshape(halves * self.local_ffn, hidden))
            fc2.append(master2[:, rows])
        self.linear_fc1 = nn.Module()
        self.linear_fc2 = nn.Module()
        self.linear_fc1.weight = _tag(nn.Parameter(torch.stack(fc1)))
        self.linear_fc2.weight = _tag(nn.Parameter(torch.stack(fc2)))
        self.linear_fc1.bias = self.linear_fc2.bias = None
        if config.add_bias_linear:
            self.linear_fc1.bias = _tag(nn.Parameter(torch.zeros(self.num_local_experts, halves * self.local_ffn,
                                                                 dtype=config.params_dtype)))
            self.linear_fc2.bias = _tag(nn.Parameter(torch.zeros(self.num_local_experts, hidden,
                                                                 dtype=config.params_dtype)))
            # Added by etp rank 0 only (the others' outputs are partial sums of the same tokens);
            # the gradient is summed over etp and counted once in the norm.
            self.linear_fc2.bias.allreduce_over_expert_tp = True
            self.linear_fc2.bias.duplicate_in_norm = etp_rank != 0

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`tokens [N, h]` sorted by local expert, `counts[e]` rows for each (a device tensor) ->
        outputs `[N, h]` (partial sums over the etp ranks when the experts are split)."""
        if torch.is_autocast_enabled(tokens.device.type):
            tokens = tokens.to(torch.get_autocast_dtype(tokens.device.type))
        fc1, fc2 = (layer.weight.to(tokens.dtype) for layer in (self.linear_fc1, self.linear_fc2))
        hidden = grouped_linear(tokens, fc1, counts, self.grouped)
        if self.linear_fc1.bias is not None:
            hidden = hidden + self._per_token(self.linear_fc1.bias.to(hidden.dtype), counts, tokens.shape[0])
        output = grouped_linear(activate(hidden, self.config), fc2, counts, self.grouped)
        if self.linear_fc2.bias is not None and self.etp_rank == 0:
            output = output + self._per_token(self.linear_fc2.bias.to(output.dtype), counts, tokens.shape[0])
        return output

    @staticmethod
    def _per_token(bias: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """Each row's expert bias: `bias [E, d]` repeated `counts[e]` times (`rows` in all)."""
        return torch.repeat_interleave(bias, counts, dim=0, output_size=rows)

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        """Global `[E, ...]` tensors: fc1 as `[E, 2, F, h]` (gate, up), fc2 as `[E, h, F]`, biases
        `[E, 2, F]` and `[E, h]`; this rank's box at its first expert and its etp slice of F."""
        halves, hidden = (2 if self.gated else 1), self.linear_fc2.weight.shape[1]
        # (name, parameter, view of one expert's piece, index of the F dim in that view)
        pieces = [("linear_fc1.weight", self.linear_fc1.weight, (halves, self.local_ffn, hidden), 1),
                  ("linear_fc2.weight", self.linear_fc2.weight, (hidden, self.local_ffn), 1)]
        if self.linear_fc1.bias is not None:
            pieces += [("linear_fc1.bias", self.linear_fc1.bias, (halves, self.local_ffn), 1),
                       ("linear_fc2.bias", self.linear_fc2.bias, (hidden,), None)]
        result = {}
        for name, param, view, ffn_dim in pieces:
            shape, offset = [self.num_experts, *view], [self.first_expert] + [0] * len(view)
            replica = self.edp_rank
            if ffn_dim is None:  # replicated over etp: rank 0 of each expert-data-parallel replica writes it
                replica = self.edp_rank * self.etp_size + self.etp_rank
            else:
                shape[1 + ffn_dim], offset[1 + ffn_dim] = self.ffn, self.etp_rank * self.local_ffn
            key = f"{prefix}{name}"
            result[key] = ShardedTensor(key, param.detach().view(self.num_local_experts, *view), tuple(shape),
                                        tuple(offset), replica_id=replica)
        return result
