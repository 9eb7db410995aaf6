"""Where the GPU waits for the host: the idle intervals of a torch.profiler trace, and who was late.

A step's time that is not kernel time is the GPU idling between kernels, because the host had not
launched the next one yet (a host sync drained the queue, or host work between launches took
longer than the kernels did). This reads a Chrome trace written by torch.profiler (as
`train_throughput.py --profile DIR` writes them, or `kernel_breakdown.profile_steps`), merges the
device's kernel, memcpy and memset intervals into busy time, and reports each idle interval longer
than `--min-us`: how long, the kernel that ended it, and the host ops that were open when that
kernel was launched (found through the launch's correlation id). It also sums the host-sync-like
runtime calls.

    python tools/benchmark/trace_gaps.py /tmp/prof_dlm --steps 3 --top 15
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = ("Synchronize", "Memcpy")


@dataclass
class Gap:
    microseconds: float
    start: float
    next_event: dict


def load_events(path: str) -> List[dict]:
    """The trace's events, from a .json or .json.gz file or the one trace in a directory."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.json.gz")))
        if len(found) != 1:
            raise SystemExit(f"{path}: {len(found)} traces found; name one of them")
        path = found[0]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _timed(events: List[dict], categories) -> List[dict]:
    return [e for e in events if e.get("cat") in categories and "dur" in e]


def idle_gaps(device_events: List[dict], min_us: float) -> List[Gap]:
    """Intervals over `min_us` in which no device event ran (overlapping events merged)."""
    ordered = sorted(device_events, key=lambda e: e["ts"])
    gaps, busy_until = [], ordered[0]["ts"] if ordered else 0.0
    for event in ordered:
        if event["ts"] - busy_until > min_us:
            gaps.append(Gap(event["ts"] - busy_until, busy_until, event))
        busy_until = max(busy_until, event["ts"] + event["dur"])
    return gaps


def open_ops(cpu_ops: List[dict], when: float, thread, depth: int = 6) -> str:
    """The host ops of `thread` open at `when`, outermost first."""
    around = [o for o in cpu_ops if o.get("tid") == thread and o["ts"] <= when <= o["ts"] + o["dur"]]
    around.sort(key=lambda o: -o["dur"])
    return " > ".join(o["name"][:48] for o in around[:depth]) or "(no op open)"


def summarize(events: List[dict], min_us: float = 20.0, top: int = 15, steps: int = 1) -> dict:
    """Span, kernel time, the idle gaps (total, the largest with their launchers) and sync calls."""
    device = _timed(events, DEVICE_CATEGORIES)
    if not device:
        raise SystemExit("the trace holds no device events (a CPU-only profile has no gaps to read)")
    runtime = _timed(events, RUNTIME_CATEGORIES)
    cpu_ops = _timed(events, ("cpu_op",))
    launches = {e.get("args", {}).get("correlation"): e for e in runtime}
    gaps = idle_gaps(device, min_us)
    start = min(e["ts"] for e in device)
    span = max(e["ts"] + e["dur"] for e in device) - start
    largest = []
    for gap in sorted(gaps, key=lambda g: -g.microseconds)[:top]:
        launch = launches.get(gap.next_event.get("args", {}).get("correlation"))
        where = open_ops(cpu_ops, launch["ts"], launch.get("tid")) if launch else "(launch not in the trace)"
        largest.append({"ms": gap.microseconds / 1e3, "next": gap.next_event["name"], "launched_in": where})
    syncs: Dict[str, float] = collections.defaultdict(float)
    for call in runtime:
        if any(word in call["name"] for word in SYNC_CALLS):
            syncs[call["name"]] += call["dur"] / 1e3
    return {"steps": steps, "span_ms": span / 1e3, "gap_ms": sum(g.microseconds for g in gaps) / 1e3,
            "gaps": len(gaps), "min_us": min_us, "largest": largest, "sync_ms": dict(syncs)}


def format_summary(summary: dict) -> str:
    steps = summary["steps"]
    lines = [f"device span {summary['span_ms']:.1f} ms over {steps} step(s); idle gaps over "
             f"{summary['min_us']:g} us: {summary['gaps']}, {summary['gap_ms']:.2f} ms "
             f"({summary['gap_ms'] / steps:.2f} ms a step)"]
    lines += [f"{g['ms']:8.3f} ms before {g['next'][:50]!r}, launched in {g['launched_in']}"
              for g in summary["largest"]]
    lines.append("host-sync-like runtime calls, ms: " +
                 ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(summary["sync_ms"].items())))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="A torch.profiler Chrome trace (.json, .json.gz) or a directory with one.")
    parser.add_argument("--min-us", type=float, default=20.0, help="Shorter idle intervals are not gaps.")
    parser.add_argument("--top", type=int, default=15, help="How many of the largest gaps to list.")
    parser.add_argument("--steps", type=int, default=1, help="Steps the trace holds (for the per-step figure).")
    args = parser.parse_args(argv)
    summary = summarize(load_events(args.trace), args.min_us, args.top, args.steps)
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
