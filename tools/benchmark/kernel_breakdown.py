"""Where a training step's time goes: torch.profiler over a few steps, grouped by name patterns.

Categories: attention, gemm (matmuls), loss (cross-entropy / log-softmax, ours included),
optimizer (AdamW, foreach kernels, gradient clipping) and other. On CUDA every kernel's device
time is attributed: attention and GEMM kernels by their own names (cuDNN/flash SDPA, cuBLAS
gemm / nvjet / cutlass), the rest by the op that launched them and that op's callers (the loss
and the optimizer are recognised by their ops and autograd nodes, not by their elementwise
kernels); device time no op claims counts as other. On CPU each op's self CPU time is
attributed the same way. GEMMs of the output layer count as gemm, not loss.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch
from torch.autograd import DeviceType

CATEGORIES = ("attention", "gemm", "loss", "optimizer", "other")
ATTENTION = ("attention", "sdpa", "fmha", "flash_fwd", "flash_bwd")
GEMM = ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
        "aten::_scaled_mm", "aten::_grouped_mm")
LOSS = ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss", "nllloss")
# vector_norm: our gradient clipping's per-tensor norms (the model's norms never call it).
OPTIMIZER = ("adam", "foreach", "optimizer", "multi_tensor_apply", "clip_grad", "vector_norm")


def classify(name: str, callers: Iterable[str] = ()) -> str:
    """The category of a kernel or op `name` launched under the ops `callers` (innermost first)."""
    own = name.lower()
    chain = " ".join(callers).lower()
    if any(pattern in own or pattern in chain for pattern in ATTENTION):
        return "attention"
    if any(pattern in own for pattern in GEMM):
        return "gemm"
    for category, patterns in (("loss", LOSS), ("optimizer", OPTIMIZER)):
        if any(pattern in own or pattern in chain for pattern in patterns):
            return category
    return "other"


def _callers(event) -> List[str]:
    """Names of `event` and the ops around it, innermost first."""
    names, parent = [], event
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def breakdown(events, on_cuda: bool, steps: int) -> dict:
    """Milliseconds per step by category (and their shares) from a profiler's `events()`."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if on_cuda:
        for event in cpu_events:
            for kernel in event.kernels:
                totals[classify(kernel.name, _callers(event))] += kernel.duration
        device_total = sum(e.time_range.end - e.time_range.start for e in events
                           if e.device_type == DeviceType.CUDA)
        totals["other"] += max(0.0, device_total - sum(totals.values()))
    else:
        for event in cpu_events:
            totals[classify(event.name, _callers(event.cpu_parent))] += event.self_cpu_time_total
    total = sum(totals.values())
    return {"time": "CUDA kernel time" if on_cuda else "CPU time (self time of ops)", "steps": steps,
            "ms_per_step": {key: value / 1e3 / steps for key, value in totals.items()},
            "total_ms_per_step": total / 1e3 / steps,
            "share": {key: (value / total if total else 0.0) for key, value in totals.items()}}


def profile_steps(step: Callable[[torch.Tensor, int], torch.Tensor], batches: List[torch.Tensor],
                  first_index: int, device: torch.device, trace_path: Optional[str] = None) -> dict:
    """Run `step` on `batches` under torch.profiler (after warm-up); the breakdown, and a Chrome trace."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        for offset, batch in enumerate(batches):
            step(batch, first_index + offset)
        if on_cuda:
            torch.cuda.synchronize(device)
    if trace_path:
        profiler.export_chrome_trace(trace_path)
    result = breakdown(profiler.events(), on_cuda, len(batches))
    result["trace"] = trace_path
    return result


def format_table(name: str, result: dict) -> str:
    lines = [f"\n{name}: {result['time']} over {result['steps']} profiled steps",
             "| category | ms/step | share |", "|---|---|---|"]
    for category in CATEGORIES:
        lines.append(f"| {category} | {result['ms_per_step'][category]:.2f} | "
                     f"{100 * result['share'][category]:.1f}% |")
    lines.append(f"| total | {result['total_ms_per_step']:.2f} | 100% |")
    return "\n".join(lines)

