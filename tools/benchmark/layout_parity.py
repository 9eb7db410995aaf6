"""Train the same model under several parallel layouts and compare losses and throughput.

    python tools/benchmark/layout_parity.py --script examples/dlm_training/dlm_pretrain_1.7b.sh \
        --iters 20 --extra "--num-layers 16" --layouts 1gpu dp2 tp2 [--json OUT]

Each layout runs the launch script through torchrun with the same data, seed and global
batch (micro-batch 2, --global-batch-size 4 by default), logging every iteration. Prints per-step `lm loss`
of each layout next to the single-GPU run, the largest relative difference, and the median
tokens/s/GPU and TFLOP/s/GPU over the second half of the steps (after warm-up).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

LAYOUTS = {
    "1gpu": (1, ""),
    "dp2": (2, ""),
    "tp2": (2, "--tensor-model-parallel-size 2"),
    "tp2_sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
}
LINE = re.compile(r"iteration +(\d+)/.*?tokens per second per GPU: ([0-9.]+).*?lm loss: ([0-9.E+-]+)")
TFLOPS = re.compile(r"iteration +(\d+)/.*?\(TFLOP/s/GPU\): ([0-9.]+)")


def run_layout(name: str, script: str, iters: int, extra: str, log_dir: str, global_batch: int) -> dict:
    gpus, flags = LAYOUTS[name]
    env = dict(os.environ, GPUS_PER_NODE=str(gpus), TRAIN_ITERS=str(iters), LR_WARMUP_ITERS="2",
               WSD_DECAY_ITERS="2", MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE=str(global_batch), LOG_INTERVAL="1",
               EXTRA_ARGS=f"{extra} {flags} --eval-iters 0", MASTER_PORT=str(29500 + len(name)))
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "w") as log:
        code = subprocess.run(["bash", script], env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    text = open(log_path).read()
    if code != 0:
        sys.exit(f"{name}: exit code {code}\n{text[-3000:]}")
    steps = {int(i): (float(tok), float(loss)) for i, tok, loss in LINE.findall(text)}
    tflops = {int(i): float(v) for i, v in TFLOPS.findall(text)}
    later = [i for i in sorted(steps) if i > iters // 2]
    return {"losses": [steps[i][1] for i in sorted(steps)],
            "tokens_per_s_per_gpu": statistics.median(steps[i][0] for i in later),
            "tflops_per_gpu": statistics.median(tflops[i] for i in later), "gpus": gpus}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--extra", default="", help="Flags appended to the script's (e.g. a smaller depth).")
    parser.add_argument("--global-batch-size", type=int, default=4, help="Sequences per step (micro-batch 2).")
    parser.add_argument("--layouts", nargs="+", default=["1gpu", "dp2", "tp2"], choices=list(LAYOUTS))
    parser.add_argument("--log-dir", default="runs/layout_parity")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    results = {name: run_layout(name, args.script, args.iters, args.extra, args.log_dir, args.global_batch_size)
               for name in args.layouts}
    base = results[args.layouts[0]]
    print("\nstep | " + " | ".join(args.layouts))
    for step in range(args.iters):
        print(f"{step + 1:4d} | " + " | ".join(f"{results[n]['losses'][step]:.6f}" for n in args.layouts))
    print("\n| layout | GPUs | max rel. loss diff vs " + args.layouts[0] +
          " | tokens/s/GPU (median) | total tokens/s | speed-up | TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    base_total = base["tokens_per_s_per_gpu"] * base["gpus"]
    for name in args.layouts:
        r = results[name]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        total = r["tokens_per_s_per_gpu"] * r["gpus"]
        print(f"| {name} | {r['gpus']} | {diff:.2e} | {r['tokens_per_s_per_gpu']:,.0f} | {total:,.0f} | "
              f"{total / base_total:.2f}x | {r['tflops_per_gpu']:.1f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
