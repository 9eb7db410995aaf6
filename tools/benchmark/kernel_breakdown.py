"""Where a training step's time goes: torch.profiler over a few steps, grouped by name patterns.

Categories: attention, gemm (matmuls), grouped_gemm (torch grouped_mm and transformers'
fallback for it: the MoE experts as one GEMM), moe (everything else inside an MoE layer, forward
and backward: router softmax/top-k and balancing losses, the dispatch's sorts, gathers and
scatters, the experts' activation, the weighted combine), loss (cross-entropy / log-softmax, ours
included), optimizer (AdamW, foreach kernels, gradient clipping) and other. On CUDA every
kernel's device time is attributed: attention and GEMM kernels by their own names (cuDNN/flash
SDPA, cuBLAS gemm / nvjet / cutlass), the rest by the op that launched them and that op's callers
(the loss and the optimizer are recognised by their ops and autograd nodes, not by their
elementwise kernels); device time no op claims counts as other. On CPU each op's self CPU time is
attributed the same way. GEMMs of the output layer count as gemm, not loss; the router's and a
per-expert loop's GEMMs count as gemm, not moe.

MoE layers are found by `moe_scopes` while profiling: each module with `experts` (our MoELayer,
transformers' sparse MoE blocks) runs its forward inside a profiler scope `moe_layer`, and its
backward inside `moe_layer_backward` (entered when the gradient reaches the layer's output,
left when it leaves through its input).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import torch
from torch.autograd import DeviceType

import trace_gaps  # beside this file, which its callers put on sys.path

CATEGORIES = ("attention", "gemm", "grouped_gemm", "moe", "loss", "optimizer", "other")
ATTENTION = ("attention", "sdpa", "fmha", "flash_fwd", "flash_bwd")
# torch's ops (aten::_grouped_mm, the sm90 cutlass kernel's grouped problem shape) and transformers'.
GROUPED_GEMM = ("grouped_mm", "groupproblemshape", "grouped_gemm")
GEMM = ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
        "aten::_scaled_mm")
MOE_SCOPE = "moe_layer"
"""The profiler scope of an MoE layer's forward (and, suffixed _backward, its backward)."""
LOSS = ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss", "nllloss")
# vector_norm: our gradient clipping's per-tensor norms (the model's norms never call it).
TOP_KERNELS = 8
"""Kernels (ops on CPU) listed per category, the longest first."""
OPTIMIZER = ("adam", "foreach", "optimizer", "multi_tensor_apply", "clip_grad", "vector_norm")


def classify(name: str, callers: Iterable[str] = ()) -> str:
    """The category of a kernel or op `name` launched under the ops `callers` (innermost first)."""
    own = name.lower()
    chain = " ".join(callers).lower()
    if any(pattern in own or pattern in chain for pattern in ATTENTION):
        return "attention"
    if any(pattern in own or pattern in chain for pattern in GROUPED_GEMM):
        return "grouped_gemm"
    if any(pattern in own for pattern in GEMM):
        return "gemm"
    if MOE_SCOPE in own or MOE_SCOPE in chain or own.startswith("_backwardscope"):  # (the scope's own edges)
        return "moe"
    for category, patterns in (("loss", LOSS), ("optimizer", OPTIMIZER)):
        if any(pattern in own or pattern in chain for pattern in patterns):
            return category
    return "other"


def callers(event) -> List[str]:
    """Names of `event` and the ops around it, innermost first."""
    names, parent = [], event
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _enclosing_ops(ops: List[dict], timestamp: float) -> List[str]:
    """Names of the ops (sorted by start) whose interval holds `timestamp`, innermost first."""
    return [op["name"] for op in reversed(ops) if op["ts"] <= timestamp <= op["ts"] + op["dur"]]


def cuda_breakdown(trace: dict) -> dict:
    """Device time per category from a Chrome trace: every kernel counted once, by its own name
    or by the ops around the runtime call that launched it (matched by correlation id)."""
    events = trace["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops_by_thread = defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "user_annotation") and "dur" in event:
            ops_by_thread[event["tid"]].append(event)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda op: op["ts"])
    totals = dict.fromkeys(CATEGORIES, 0.0)
    kernels = {category: defaultdict(float) for category in CATEGORIES}
    for kernel in (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        callers = [] if launch is None else _enclosing_ops(ops_by_thread[launch["tid"]], launch["ts"])
        category = classify(kernel["name"], callers)
        totals[category] += kernel["dur"]
        # Named with the innermost ops that launched it: "other" is otherwise hard to place.
        kernels[category][" <- ".join([kernel["name"][:80], *callers[:2]])] += kernel["dur"]
    return totals, kernels


def breakdown(events, on_cuda: bool, steps: int, trace: Optional[dict] = None, top: int = TOP_KERNELS) -> dict:
    """Milliseconds per step by category (and their shares), and each category's `top` longest kernels:
    device time from the exported trace on CUDA, self CPU time of the profiler's `events()` on CPU."""
    if on_cuda:
        totals, kernels = cuda_breakdown(trace)
    else:
        totals = dict.fromkeys(CATEGORIES, 0.0)
        kernels = {category: defaultdict(float) for category in CATEGORIES}
        for event in events:
            if event.device_type == DeviceType.CPU and not event.is_async:
                category = classify(event.name, callers(event.cpu_parent))
                totals[category] += event.self_cpu_time_total
                kernels[category][event.name] += event.self_cpu_time_total
    total = sum(totals.values())
    longest = {category: [(name, value / 1e3 / steps) for name, value in
                          sorted(named.items(), key=lambda item: -item[1])[:top]]
               for category, named in kernels.items()}
    return {"time": "CUDA kernel time" if on_cuda else "CPU time (self time of ops)", "steps": steps,
            "ms_per_step": {key: value / 1e3 / steps for key, value in totals.items()},
            "total_ms_per_step": total / 1e3 / steps,
            "share": {key: (value / total if total else 0.0) for key, value in totals.items()},
            "top": longest}


class _BackwardScope(torch.autograd.Function):
    """The identity, whose backward enters (`enter`) or leaves the profiler scope `scope`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scope, enter: bool) -> torch.Tensor:
        ctx.scope, ctx.enter = scope, enter
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.enter:
            ctx.scope.__enter__()
        else:
            ctx.scope.__exit__(None, None, None)
        return grad, None, None


def _bracket(tensor, scope, enter: bool):
    """`tensor` through _BackwardScope when its gradient will flow (else itself)."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _BackwardScope.apply(tensor, scope, enter)
    return tensor


@contextmanager
def moe_scopes(model: torch.nn.Module) -> Iterator[int]:
    """Run every MoE layer of `model` (a module with `experts`) inside the profiler scopes
    MOE_SCOPE (forward) and MOE_SCOPE_backward (backward) while the block runs; yields their number."""
    layers = [module for module in model.modules() if isinstance(getattr(module, "experts", None), torch.nn.Module)]
    open_scopes = []

    def before(module, args):
        forward, backward = (torch.profiler.record_function(name) for name in (MOE_SCOPE, f"{MOE_SCOPE}_backward"))
        hidden = _bracket(args[0], backward, enter=False)  # the backward scope ends where the gradient leaves
        forward.__enter__()
        open_scopes.append((forward, backward, hidden is not args[0]))
        return (hidden, *args[1:])

    def after(module, args, output):
        forward, backward, bracketed = open_scopes.pop()
        forward.__exit__(None, None, None)
        if not bracketed:
            return output
        if isinstance(output, tuple):  # older transformers' blocks also return the router logits
            return (_bracket(output[0], backward, enter=True), *output[1:])
        return _bracket(output, backward, enter=True)

    handles = [hook for layer in layers
               for hook in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
    try:
        yield len(layers)
    finally:
        for handle in handles:
            handle.remove()


def profile_steps(step: Callable[[int], object], indices: Sequence[int], device: torch.device,
                  trace_path: Optional[str] = None, top: int = TOP_KERNELS) -> dict:
    """Run `step(index)` for each of `indices` under torch.profiler (after warm-up); the breakdown (with
    each category's `top` longest kernels), and a Chrome trace."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        for index in indices:
            step(index)
        if on_cuda:
            torch.cuda.synchronize(device)
    trace = None
    if on_cuda:  # the trace links each kernel to the runtime call, hence the ops, that launched it
        with tempfile.TemporaryDirectory() as scratch:
            path = trace_path or os.path.join(scratch, "trace.json")
            profiler.export_chrome_trace(path)
            with open(path) as handle:
                trace = json.load(handle)
    elif trace_path:
        profiler.export_chrome_trace(trace_path)
    result = breakdown(profiler.events(), on_cuda, len(indices), trace, top)
    result["trace"] = trace_path
    if trace is not None:  # the GPU's idle intervals: the step time no kernel accounts for
        result["gaps"] = trace_gaps.summarize(trace["traceEvents"], steps=len(indices))
    return result


def format_table(name: str, result: dict) -> str:
    lines = [f"\n{name}: {result['time']} over {result['steps']} profiled steps",
             "| category | ms/step | share |", "|---|---|---|"]
    for category in CATEGORIES:
        lines.append(f"| {category} | {result['ms_per_step'][category]:.2f} | "
                     f"{100 * result['share'][category]:.1f}% |")
    lines.append(f"| total | {result['total_ms_per_step']:.2f} | 100% |")
    for category in CATEGORIES:
        for name, milliseconds in result.get("top", {}).get(category, []):
            lines.append(f"  {category:9s} {milliseconds:8.3f} ms  {name[:200]}")
    return "\n".join(lines)

