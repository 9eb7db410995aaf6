#!/usr/bin/env bash
# Usage: bash tools/benchmark/fp8_loss_curve.sh   (OUT=dir for the logs; TRAIN_ITERS, WARMUP; FP8_FLAGS)
# bf16 vs fp8 loss curves on the bundled corpus, one GPU (CPU float8 GEMMs take minutes a step), 200 steps. The fp8 arm's
# flags: FP8_FLAGS (default: --fp8-format hybrid, the float8 copies' layers with tensorwise scaling; e.g.
# FP8_FLAGS="--fp8-format hybrid --fp8-recipe delayed" for delayed scaling).
set -e
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' > /tmp/bin/torchrun && chmod +x /tmp/bin/torchrun
export PATH=/tmp/bin:$PATH NPROC=1 TRAIN_ITERS=${TRAIN_ITERS:-200}
COMMON="--bf16 --hidden-size 512 --ffn-hidden-size 1536 --num-attention-heads 8 --num-query-groups 4 --seq-length 512 --micro-batch-size 16 --global-batch-size 16 --lr-warmup-iters ${WARMUP:-20} --eval-iters 0"
bash examples/quickstart.sh $COMMON --tensorboard-dir /tmp/tb_bf16 > ${OUT:-/tmp}/bf16.log 2>&1
bash examples/quickstart.sh $COMMON ${FP8_FLAGS:---fp8-format hybrid} --tensorboard-dir /tmp/tb_fp8 > ${OUT:-/tmp}/fp8.log 2>&1
python3 - <<'PY'
import os, re
out = os.environ.get("OUT", "/tmp")
pattern = re.compile(r"iteration +(\d+)/.*\| lm loss: ([0-9.E+-]+) \|")
curves = {name: {int(i): float(l) for i, l in pattern.findall(open(f"{out}/{name}.log").read())} for name in ("bf16", "fp8")}
steps = sorted(curves["bf16"])
print("| steps | bf16 mean lm loss | fp8 mean lm loss | fp8 / bf16 - 1 |")
for first in range(1, len(steps) + 1, max(1, len(steps) // 10)):
    window = [s for s in steps if first <= s < first + max(1, len(steps) // 10)]
    a = sum(curves["bf16"][s] for s in window) / len(window); b = sum(curves["fp8"][s] for s in window) / len(window)
    print(f"| {window[0]}-{window[-1]} | {a:.4f} | {b:.4f} | {100 * (b / a - 1):+.2f}% |")
worst = max(abs(curves["fp8"][s] / curves["bf16"][s] - 1) for s in steps if s > len(steps) // 2)
print(f"largest per-step relative difference over the second half: {100 * worst:.2f}%")
PY
grep -h "fp8:" ${OUT:-/tmp}/fp8.log
