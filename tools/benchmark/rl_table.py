"""The table of dlm_rl.sh's runs: per run (NAME_ALGORITHM.log, its held-out reward before in
NAME_ALGORITHM.before.log), read from posttrain_rl.py's log lines.

    python tools/benchmark/rl_table.py --results DIR dlm_diffu_grpo dlm_spg ar_grpo [--windows 10]

Columns: the held-out reward (greedy, the validation line) before and after; the training reward (mean
over each step's completions at temperature 1) over the first and the last tenth of the steps, and its
curve (the mean of each of `--windows` equal spans of steps); the policy's entropy (nats per completion
token, as sampled) and the completions' mean length (tokens, to and with EOS) at the first and the last
tenth; the median rollout tokens/s (the sampler's generated tokens over its wall time), the median update
tokens/s (the rollout rows' tokens over the time the step spent after its rollouts) and the median step time
(rollouts, rewards and update).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from typing import Dict, List, Optional

VALIDATION = re.compile(r"validation reward at iteration \d+ \| reward: ([0-9.]+)")
ROLLOUTS = re.compile(r"rollouts before iteration (\d+) \| reward: ([0-9.]+) \| completion tokens: ([0-9.]+) \|.*"
                      r"\| entropy: ([0-9.]+) \| rollout tokens/s: ([0-9.]+)")
UPDATE = re.compile(r"update at iteration \d+ \|.*update tokens/s: ([0-9.]+)")
STEP = re.compile(r"iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")


def run_figures(log_text: str) -> Dict[str, List[float]]:
    """Per step (in order): rewards, completion lengths, entropy, rollout tokens/s, step ms; and the
    validation rewards."""
    figures: Dict[str, List[float]] = {"reward": [], "length": [], "entropy": [], "tokens_per_s": [],
                                       "update_tokens_per_s": [], "step_ms": [], "validation": []}
    for line in log_text.splitlines():
        if match := ROLLOUTS.search(line):
            for key, group in (("reward", 2), ("length", 3), ("entropy", 4), ("tokens_per_s", 5)):
                figures[key].append(float(match.group(group)))
        elif match := UPDATE.search(line):
            figures["update_tokens_per_s"].append(float(match.group(1)))
        elif match := STEP.search(line):
            figures["step_ms"].append(float(match.group(2)))
        elif match := VALIDATION.search(line):
            figures["validation"].append(float(match.group(1)))
    return figures


def _mean(values: List[float]) -> float:
    return sum(values) / len(values)


def curve(values: List[float], windows: int) -> List[float]:
    """The mean of each of `windows` equal spans (the last takes the remainder)."""
    span = max(len(values) // windows, 1)
    return [_mean(values[start:start + span]) for start in range(0, span * (len(values) // span), span)]


def table_row(name: str, before_text: Optional[str], log_text: str, windows: int) -> str:
    figures = run_figures(log_text)
    if not figures["reward"]:
        raise ValueError("the log holds no rollouts line")
    tenth = max(len(figures["reward"]) // 10, 1)
    before = run_figures(before_text)["validation"] if before_text else []
    held_out = (f"{before[-1]:.3f}" if before else "-") + " -> " + (
        f"{figures['validation'][-1]:.3f}" if figures["validation"] else "-")
    reward, entropy, length = figures["reward"], figures["entropy"], figures["length"]
    step = f"{statistics.median(figures['step_ms']) / 1000:.2f}" if figures["step_ms"] else "-"
    update = (f"{statistics.median(figures['update_tokens_per_s']):.0f}" if figures["update_tokens_per_s"]
              else "-")
    return (f"| {name} | {len(reward)} | {held_out} | {_mean(reward[:tenth]):.3f} -> {_mean(reward[-tenth:]):.3f} | "
            f"{' '.join(f'{value:.2f}' for value in curve(reward, windows))} | "
            f"{_mean(entropy[:tenth]):.3f} -> {_mean(entropy[-tenth:]):.3f} | "
            f"{_mean(length[:tenth]):.1f} -> {_mean(length[-tenth:]):.1f} | "
            f"{statistics.median(figures['tokens_per_s']):.0f} | {update} | {step} |")


HEADER = ("| run | steps | held-out reward, before -> after | training reward, first -> last tenth | reward curve "
          "| entropy, first -> last tenth | completion tokens, first -> last tenth | rollout tokens/s "
          "| update tokens/s | step (s) |\n|---|---|---|---|---|---|---|---|---|---|")


def _read(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return handle.read()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="The folder of NAME.log and NAME.before.log files.")
    parser.add_argument("runs", nargs="+", help="Run names (NAME of NAME.log).")
    parser.add_argument("--windows", type=int, default=10, help="Points of the reward curve.")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        log = _read(os.path.join(args.results, f"{run}.log"))
        try:
            if log is None:
                raise ValueError(f"no {run}.log in {args.results}")
            rows.append(table_row(run, _read(os.path.join(args.results, f"{run}.before.log")), log, args.windows))
        except ValueError as error:
            print(f"error: {run}: {error}", file=sys.stderr)
            return 1
    print(HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
