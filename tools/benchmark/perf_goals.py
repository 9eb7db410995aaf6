"""The speed goals' measurements in one command: each configuration of `train_throughput.py` in a
process of its own with a time limit of its own, optionally alternated with the same
configurations run from another tree or with more flags (a same-run A/B of a change), and one
table at the end.

Every configuration takes the levers the launch scripts pass (masked-only loss, its fused
kernel, compiled layers and optimizer step, bf16 Adam moments). The first run on a fresh machine
compiles every graph and kernel (over 170 s at the 1.7B shape), so it gets `--first-timeout`;
the runs after it find the compile caches warm.

    python tools/benchmark/perf_goals.py                                 # AR vs HF, DLM, 7B bf16 and fp8
    python tools/benchmark/perf_goals.py --only dlm --ab-tree ab_old --repeats 2
    python tools/benchmark/perf_goals.py --only dlm ar --ab-extra=--cache-low-precision-weights
    python tools/benchmark/perf_goals.py --smoke                         # CPU, a tiny model: the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join("tools", "benchmark", "train_throughput.py")
LEVERS = ["--seq-length", "4096", "--micro-batch-size", "2", "--masked-only-loss", "--compile-loss",
          "--torch-compile", "--compile-optimizer-step", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
GOALS = {  # the goals: AR against Hugging Face, DLM bf16, the 7B width in bf16 and fp8
    "ar": ["--model", "qwen3-1.7b", "--mode", "ar", "--steps", "15", "--warmup", "8", "--baseline", "hf"],
    "dlm": ["--model", "qwen3-1.7b", "--mode", "dlm", "--steps", "12", "--warmup", "6"],
    "7b": ["--model", "7b-shape", "--mode", "dlm", "--steps", "10", "--warmup", "8", "--fp8"],
}
SMOKE_LEVERS = ["--masked-only-loss", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
SMOKE = {
    "ar": ["--model", "tiny", "--mode", "ar", "--steps", "2", "--warmup", "1", "--baseline", "hf"],
    "dlm": ["--model", "tiny", "--mode", "dlm", "--steps", "2", "--warmup", "1"],
    "7b": ["--model", "tiny", "--mode", "dlm", "--steps", "2", "--warmup", "1", "--num-layers", "3"],
}


def run_one(arm: str, tree: str, goal: str, argv: List[str], json_path: str, timeout: float) -> dict:
    """One train_throughput.py process from `tree`; its rows, or why there are none."""
    command = [sys.executable, os.path.join(tree, SCRIPT), *argv, "--json", json_path]
    started = time.monotonic()
    log_path = json_path[:-len(".json")] + ".log"
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, cwd=tree, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    record = {"arm": arm, "tree": tree, "goal": goal, "command": shlex.join(command), "log": log_path,
              "seconds": round(time.monotonic() - started, 1), "rows": []}
    if code is None:
        record["error"] = f"timed out after {timeout:g} s"
    elif code != 0 or not os.path.exists(json_path):
        record["error"] = f"exit {code} (see {log_path}): {_last_line(log_path)}"
    else:
        with open(json_path) as handle:
            result = json.load(handle)
        record["rows"] = [{key: row.get(key) for key in ("name", "median_step_ms", "tflops_per_gpu", "mfu",
                                                         "peak_memory_gib")} for row in result["rows"]]
    return record


def _last_line(log_path: str) -> str:
    """The log's last non-empty line: usually the error that ended the run."""
    with open(log_path, errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
    return lines[-1] if lines else "(empty log)"


def plan(goals: List[str], arms: List[str], repeats: int) -> List[tuple]:
    """(arm, goal, repeat) in the order they run: the arms alternate within each repeat."""
    return [(arm, goal, repeat) for goal in goals for repeat in range(repeats) for arm in arms]


def table(records: List[dict]) -> str:
    """One line per goal, row name and arm: the median over repeats, and the spread."""
    grouped: Dict[tuple, List[dict]] = {}
    for record in records:
        for row in record["rows"]:
            grouped.setdefault((record["goal"], row["name"], record["arm"]), []).append(row)
    lines = ["| goal | row | arm | runs | median ms/step (min-max) | TFLOP/s | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for (goal, name, arm), rows in grouped.items():
        ms = [row["median_step_ms"] for row in rows]
        median = statistics.median(ms)
        # Every run of a row does the same FLOPs a step: its rate and MFU at the median step time.
        best = min(rows, key=lambda row: abs(row["median_step_ms"] - median))
        at_median = best["median_step_ms"] / median
        mfu = f"{best['mfu'] * at_median:.1%}" if best["mfu"] is not None else "-"
        peak = f"{best['peak_memory_gib']:.1f}" if best["peak_memory_gib"] is not None else "-"
        lines.append(f"| {goal} | {name} | {arm} | {len(rows)} | {median:.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
                     f"{best['tflops_per_gpu'] * at_median:.4g} | {mfu} | {peak} |")
    lines += [f"- {r['goal']} ({r['arm']}): {r['error']}" for r in records if "error" in r]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(GOALS), default=list(GOALS), help="Goals to run.")
    parser.add_argument("--ab-tree", help="Another checkout (e.g. `git archive REV megatron tools | tar -x -C DIR`) "
                                          "whose runs alternate with this tree's: a same-run A/B.")
    parser.add_argument("--ab-extra", default="", help="More flags for the second arm only (with or without "
                                                       "--ab-tree): a same-run A/B of a flag. Write it "
                                                       "--ab-extra=--flag, since argparse reads a separate "
                                                       "value that starts with -- as an option.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of each goal in each arm.")
    parser.add_argument("--extra", default="", help="More train_throughput.py flags for every run.")
    parser.add_argument("--timeout", type=float, default=240.0, help="Seconds for each run after the first.")
    parser.add_argument("--first-timeout", type=float, default=420.0, help="Seconds for the first (compiling) run.")
    parser.add_argument("--out", default="perf_goals_out", help="Directory for each run's JSON and log.")
    parser.add_argument("--smoke", action="store_true", help="A tiny model, two steps, no compilation (CPU).")
    return parser


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"perf_goals.py: --repeats {args.repeats}: give 1 or more")
    arms = {"A": (ROOT, shlex.split(args.extra))}
    if args.ab_tree or args.ab_extra:
        tree = os.path.abspath(args.ab_tree) if args.ab_tree else ROOT
        if not os.path.exists(os.path.join(tree, SCRIPT)):
            raise SystemExit(f"perf_goals.py: --ab-tree {tree} has no {SCRIPT}; unpack megatron/ and tools/ there")
        arms["B"] = (tree, shlex.split(args.extra) + shlex.split(args.ab_extra))
    for arm, (tree, extra) in arms.items():
        print(f"arm {arm}: {os.path.relpath(tree, ROOT)} {shlex.join(extra)}".rstrip(), flush=True)
    presets, levers = (SMOKE, SMOKE_LEVERS) if args.smoke else (GOALS, LEVERS)
    os.makedirs(args.out, exist_ok=True)
    records = []
    for index, (arm, goal, repeat) in enumerate(plan(args.only, list(arms), args.repeats)):
        tree, extra = arms[arm]
        record = run_one(arm, tree, goal, presets[goal] + levers + extra,
                         os.path.abspath(os.path.join(args.out, f"{goal}_{arm}_{repeat}.json")),
                         args.first_timeout if index == 0 else args.timeout)
        print(f"{goal} ({arm}, run {repeat + 1}): {record['seconds']} s, "
              + (record.get("error") or ", ".join(f"{r['median_step_ms']:.1f} ms" for r in record["rows"])),
              flush=True)
        records.append(record)
    print(table(records))
    summary = os.path.join(args.out, "summary.json")
    with open(summary + ".tmp", "w") as handle:  # an earlier summary is never left half overwritten
        json.dump(records, handle, indent=1)
    os.replace(summary + ".tmp", summary)
    return records


if __name__ == "__main__":
    main()
