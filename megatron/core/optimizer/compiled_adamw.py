"""AdamW whose step is compiled: one Triton kernel per parameter (`--compile-optimizer-step`).

torch's fused AdamW reads and writes every fp32 weight, gradient and moment once (28 bytes a
parameter) but ran at 2.76 TB/s on an H200 against a 4.12 TB/s copy bandwidth
(`tools/benchmark/step_parts.py`, docs/performance_history.md). Here the same update is written per
parameter and compiled by torch.compile, which fuses each parameter's chain into one
memory-bound kernel. The learning rate, weight decay and step counts are device tensors, so a
scheduler changing them never recompiles.

It is torch's AdamW in every other respect: the same class (a subclass), parameter groups, state
keys (``step``, ``exp_avg``, ``exp_avg_sq``) and state_dict, so checkpoints, the LR scheduler and
ZeRO-1 see no difference. Like the fused kernel it divides each gradient by ``grad_scale`` (a
0-d tensor, when set) as it reads it: gradient clipping's multiply folds into the step
(`optimizer.scale_gradients`). The update is torch's single-tensor AdamW formula.

Megatron's precision-aware optimizer (`--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16`): `exp_avg_dtype` / `exp_avg_sq_dtype` store the moments in bf16. The
update still computes in fp32 (each moment is read, updated and used in fp32, then stored
rounded to nearest), so only storage and traffic shrink: 28 -> 20 bytes a parameter per step
with both, and 4 bytes a parameter less memory (two moments of 2 instead of 4 bytes). A loaded
checkpoint's moments are cast to the configured dtypes (torch's loader casts them to the parameter's).
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["CompiledAdamW", "adamw_update"]

RECOMPILE_LIMIT = 64


def adamw_update(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 exp_avg_sqs: List[torch.Tensor], steps: List[torch.Tensor], lr: torch.Tensor,
                 weight_decay: torch.Tensor, beta1: float, beta2: float, eps: float,
                 grad_scale: Optional[torch.Tensor], copies: Optional[List[Optional[torch.Tensor]]] = None) -> None:
    """One decoupled-weight-decay Adam step over lists of tensors, in place (torch's AdamW formula).
    `copies`: each parameter's low-precision working copy or None, written with the new value."""
    copies = copies or [None] * len(params)
    for param, grad, exp_avg, exp_avg_sq, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        step.add_(1)
        if grad_scale is not None:  # the divisor the fused kernel reads (the clip's scale)
            grad = grad / grad_scale
        param.mul_(1 - lr * weight_decay)
        # in fp32 whatever the moments' storage (bf16 under the precision-aware optimizer)
        first = exp_avg.float().lerp(grad, 1 - beta1)
        second = (exp_avg_sq.float() * beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg.copy_(first)
        exp_avg_sq.copy_(second)
        step_size = lr / (1 - beta1 ** step)
        denominator = (second.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
        param.sub_(step_size * first / denominator)
        if copy is not None:  # in the same kernel: 2 more bytes written instead of a later cast
            copy.copy_(param)


class CompiledAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with a compiled step; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 fused: Optional[bool] = None, exp_avg_dtype: Optional[torch.dtype] = None,
                 exp_avg_sq_dtype: Optional[torch.dtype] = None) -> None:
        del fused  # the keyword torch's AdamW takes (`optimizer._adamw` passes it): this step replaces that kernel
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        """Storage dtype of each moment; None: the parameter's."""
        # Every instance shares `adamw_update`'s code object, and each parameter group (its list of
        # shapes and dtypes, with or without working copies) is a graph of its own: a process that builds
        # several models (benchmarks, tests) would pass dynamo's default of 8 and fail under fullgraph.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._update = torch.compile(adamw_update, fullgraph=True)
        self.weight_copies = None
        """A `WeightCopies` whose copies the step writes with the update (weight_copies.py); None: none."""

    def _moment(self, param: torch.Tensor, key: str) -> torch.Tensor:
        return torch.zeros_like(param, dtype=self.moment_dtypes[key], memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch casts loaded moments to the parameter's dtype
            for key, dtype in self.moment_dtypes.items():
                if dtype is not None and key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    def _group_tensors(self, group: dict) -> tuple:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # torch's keys; the step on the parameter's device, as the fused kernel keeps it
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = self._moment(param, "exp_avg")
                state["exp_avg_sq"] = self._moment(param, "exp_avg_sq")
            elif state["step"].device != param.device:  # loaded from a checkpoint written on the host
                state["step"] = state["step"].to(param.device)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            tensors = self._group_tensors(group)
            if not tensors[0]:
                continue
            device = tensors[0][0].device
            # Tensors, not Python floats: the scheduler's new values every step reuse the compiled code.
            lr = torch.tensor(float(group["lr"]), dtype=torch.float32).to(device, non_blocking=True)
            decay = torch.tensor(float(group["weight_decay"]), dtype=torch.float32).to(device, non_blocking=True)
            divisor = None if scale is None else scale.to(device=device, dtype=torch.float32)
            beta1, beta2 = group["betas"]
            copies = None if self.weight_copies is None else [self.weight_copies.copy_of(p) for p in tensors[0]]
            self._update(*tensors, lr, decay, float(beta1), float(beta2), float(group["eps"]), divisor, copies)
            if copies is not None:
                self.weight_copies.written([p for p, copy in zip(tensors[0], copies) if copy is not None])
        return loss
