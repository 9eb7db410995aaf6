"""Train the same model under several parallel layouts and compare losses, throughput and the
pipeline bubble.

    python tools/benchmark/layout_parity.py --script examples/dlm_training/dlm_pretrain_1.7b.sh \\
        --iters 20 --extra "--num-layers 16" --layouts 1gpu dp2 tp2sp pp2 pp2v2 [--json OUT] [--check-only]

A layout is named by its sizes, in any order: `tp2` (tensor parallel; `sp` adds sequence
parallelism), `pp4` (pipeline stages; `v2`: two interleaved virtual stages per rank), `cp2`
(context parallel), `ep4` (expert parallel, within the data-parallel ranks), `dp2` (data
parallel); `1gpu` is all ones. The layout's GPUs are tp x pp x cp x dp, e.g. `tp2pp2dp2` = 8.
Each layout runs the launch script through torchrun (GPUS_PER_NODE, the script's environment
variables of examples/launch_common.sh) with the same data, seed and global batch, logging every
iteration; pipelined layouts also run the level-2 timers, whose report states each stage's
measured bubble. Prints every step's `lm loss` next to the first layout's, and per layout: the
largest relative loss difference, the median tokens/s/GPU and TFLOP/s/GPU over the second half
of the steps, the total against the first layout's (speed-up and its efficiency per GPU) and,
for pipelines, the median measured bubble against 1F1B's (p - 1) / (m * v + p - 1). `--check-only`
validates every layout's flags for its number of ranks (the scripts' CHECK_ONLY=1) and launches nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.core.pipeline_parallel.compute_clock import bubble_formula  # noqa: E402

LINE = re.compile(r"iteration +(\d+)/.*?tokens per second per GPU: ([0-9.]+).*?lm loss: ([0-9.E+-]+)")
TFLOPS = re.compile(r"iteration +(\d+)/.*?\(TFLOP/s/GPU\): ([0-9.]+)")
BUBBLE = re.compile(r"pipeline bubble \(1 - compute / forward-backward\): min [0-9.]+%, mean ([0-9.]+)%")
TOKEN = re.compile(r"(tp|pp|cp|ep|dp|v)(\d+)|sp")


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    virtual: int = 1
    sequence_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def flags(self) -> List[str]:
        """pretrain_difflm.py's flags for this layout (data parallelism is what the GPUs leave). Every
        size is given, 1 included, so a script's own layout (the 7B script's TP=2 x PP=2) gives way."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                 "--context-parallel-size", str(self.cp), "--expert-model-parallel-size", str(self.ep)]
        if self.virtual > 1:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(self.virtual)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.pp > 1:  # each stage times its compute: the measured bubble
            flags += ["--timing-log-level", "2"]
        return flags

    def bubble_formula(self, global_batch: int, micro_batch: int) -> Optional[float]:
        """1F1B's bubble for this layout's micro-batches per replica; None without a pipeline."""
        if self.pp == 1:
            return None
        return bubble_formula(self.pp, global_batch // (micro_batch * self.dp), self.virtual)


def parse_layout(name: str) -> Layout:
    """`tp2pp2dp2` -> Layout(tp=2, pp=2, dp=2); raises ValueError naming what is wrong."""
    if name == "1gpu":
        return Layout(name)
    sizes: Dict[str, int] = {}
    position = 0
    for match in TOKEN.finditer(name):
        if match.start() != position:
            break
        key = match.group(1) or "sp"
        if key in sizes:
            raise ValueError(f"layout {name!r} names {key} twice")
        sizes[key] = int(match.group(2)) if match.group(2) else 1
        position = match.end()
    if position != len(name) or not sizes:
        raise ValueError(f"layout {name!r}: use sizes such as tp2, pp4, v2, cp2, ep4, dp2 and sp (e.g. tp2sppp2), "
                         "or 1gpu")
    if any(size < 1 for key, size in sizes.items() if key != "sp"):
        raise ValueError(f"layout {name!r}: every size must be >= 1")
    if "v" in sizes and sizes.get("pp", 1) == 1:
        raise ValueError(f"layout {name!r}: virtual stages (v) need a pipeline (pp2 or more)")
    if "sp" in sizes and sizes.get("tp", 1) == 1:
        raise ValueError(f"layout {name!r}: sequence parallelism (sp) needs tensor parallelism (tp2 or more)")
    layout = Layout(name, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1),
                    ep=sizes.get("ep", 1), dp=sizes.get("dp", 1), virtual=sizes.get("v", 1),
                    sequence_parallel="sp" in sizes)
    if (layout.dp * layout.cp) % layout.ep:
        raise ValueError(f"layout {name!r}: expert parallelism ep{layout.ep} must divide dp x cp "
                         f"({layout.dp * layout.cp})")
    return layout


def parse_log(text: str, iters: int) -> dict:
    """Losses of every step, and the medians over the second half of the steps."""
    steps = {int(i): (float(tok), float(loss)) for i, tok, loss in LINE.findall(text)}
    tflops = {int(i): float(v) for i, v in TFLOPS.findall(text)}
    if sorted(steps) != list(range(1, iters + 1)):
        raise ValueError(f"the log has iterations {sorted(steps)[:5]}... of {iters}")
    later = [i for i in sorted(steps) if i > iters // 2]
    bubbles = [float(mean) / 100 for mean in BUBBLE.findall(text)]
    return {"losses": [steps[i][1] for i in sorted(steps)],
            "tokens_per_s_per_gpu": statistics.median(steps[i][0] for i in later),
            "tflops_per_gpu": statistics.median(tflops[i] for i in later) if tflops else None,
            "bubble": statistics.median(bubbles[len(bubbles) // 2:]) if bubbles else None}


def _environment(layout: Layout, args: argparse.Namespace, port: int) -> Dict[str, str]:
    """The launch script's environment for this layout (examples/launch_common.sh)."""
    return dict(os.environ, GPUS_PER_NODE=str(layout.gpus), TRAIN_ITERS=str(args.iters), LR_WARMUP_ITERS="2",
                WSD_DECAY_ITERS="2", MICRO_BATCH_SIZE=str(args.micro_batch_size),
                GLOBAL_BATCH_SIZE=str(args.global_batch_size), LOG_INTERVAL="1",
                EXTRA_ARGS=" ".join([args.extra, *layout.flags(), "--eval-iters 0"]), MASTER_PORT=str(port))


def check_layout(layout: Layout, args: argparse.Namespace) -> Optional[str]:
    """None if the script's flags hold for this layout's ranks (CHECK_ONLY=1: nothing launched, no GPU
    needed), else the line that says why not."""
    run = subprocess.run(["bash", args.script], env=dict(_environment(layout, args, args.port), CHECK_ONLY="1"),
                         capture_output=True, text=True)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    return None if run.returncode == 0 else (lines[-1] if lines else f"exit code {run.returncode}")


def run_layout(layout: Layout, args: argparse.Namespace, port: int) -> dict:
    env = _environment(layout, args, port)
    log_path = os.path.join(args.log_dir, f"{layout.name}.log")
    with open(log_path, "w") as log:
        code = subprocess.run(["bash", args.script], env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    text = open(log_path).read()
    if code != 0:
        sys.exit(f"{layout.name}: exit code {code} (log: {log_path})\n{text[-3000:]}")
    result = parse_log(text, args.iters)
    result.update(gpus=layout.gpus, flags=layout.flags(),
                  bubble_formula=layout.bubble_formula(args.global_batch_size, args.micro_batch_size))
    return result


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(layouts: List[Layout], results: Dict[str, dict]) -> List[str]:
    """The per-step losses, then one row per layout against the first."""
    names = [layout.name for layout in layouts]
    base = results[names[0]]
    lines = ["step | " + " | ".join(names)]
    lines += [f"{step + 1:4d} | " + " | ".join(f"{results[n]['losses'][step]:.6f}" for n in names)
              for step in range(len(base["losses"]))]
    lines += ["", f"| layout | GPUs | max rel. loss diff vs {names[0]} | tokens/s/GPU (median) | total tokens/s | "
              "speed-up | per-GPU efficiency | TFLOP/s/GPU | bubble measured | bubble 1F1B |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base_total = base["tokens_per_s_per_gpu"] * base["gpus"]
    for name in names:
        r = results[name]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        total = r["tokens_per_s_per_gpu"] * r["gpus"]
        speedup = total / base_total
        tflops = "-" if r["tflops_per_gpu"] is None else f"{r['tflops_per_gpu']:.1f}"
        lines.append(f"| {name} | {r['gpus']} | {diff:.2e} | {r['tokens_per_s_per_gpu']:,.0f} | {total:,.0f} | "
                     f"{speedup:.2f}x | {speedup * base['gpus'] / r['gpus']:.1%} | {tflops} | "
                     f"{_percent(r['bubble'])} | {_percent(r['bubble_formula'])} |")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--extra", default="", help="Flags appended to the script's (e.g. a smaller depth).")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=4, help="Sequences per step.")
    parser.add_argument("--layouts", nargs="+", default=["1gpu", "dp2", "tp2"],
                        help="Layout names (see the module docstring); the first is the reference.")
    parser.add_argument("--log-dir", default="runs/layout_parity")
    parser.add_argument("--port", type=int, default=29500, help="torchrun's master port of the first layout.")
    parser.add_argument("--json")
    parser.add_argument("--check-only", action="store_true",
                        help="Validate every layout's flags for its number of ranks and stop (no GPU needed).")
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(name) for name in args.layouts]
    except ValueError as error:
        parser.error(str(error))
    if args.iters < 2 or not os.path.isfile(args.script):
        parser.error(f"--iters must be >= 2 and --script a launch script (got {args.iters}, {args.script!r})")
    for layout in layouts:
        if args.global_batch_size % (args.micro_batch_size * layout.dp):
            parser.error(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
                         f"x dp ({args.micro_batch_size} x {layout.dp}) for {layout.name}")
    if args.check_only:
        problems = {layout.name: check_layout(layout, args) for layout in layouts}
        for name, problem in problems.items():
            print(f"{name}: {problem or 'the flags hold'}")
        if any(problems.values()):
            sys.exit(1)
        return {}
    os.makedirs(args.log_dir, exist_ok=True)
    results = {layout.name: run_layout(layout, args, args.port + index) for index, layout in enumerate(layouts)}
    print("\n" + "\n".join(table(layouts, results)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
