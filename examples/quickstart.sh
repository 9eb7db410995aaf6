#!/usr/bin/env bash
# Train a tiny diffusion LM on synthetic documents with 2 CPU processes (gloo): no data, no GPU.
#   bash examples/quickstart.sh                 # difflm-noshift, bidirectional attention
#   MODE=vanilla bash examples/quickstart.sh    # the same model trained autoregressively
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
MODE=${MODE:-difflm-noshift}
torchrun --standalone --nproc_per_node="$NPROC" pretrain_difflm.py \
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu \
    --qk-layernorm --disable-bias-linear --seq-length 64 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-50}" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --weight-decay 0.0 \
    --mock-data --vocab-size 128 --add-mask-token \
    --model-running-mode "$MODE" --attention-mask-type no_mask --difflm-t-sampling antithetic \
    --log-interval 1 --log-throughput --eval-interval 25 --eval-iters 2 \
    --tensorboard-dir "${TENSORBOARD_DIR:-runs/quickstart-$MODE}" "$@"
