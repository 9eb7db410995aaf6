#!/usr/bin/env bash
# 125M masked diffusion LM: 12 layers, hidden 768, 12 heads, SwiGLU 2048, seq 2048.
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-dlm_125m}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 100000 1000 10000  # iterations: run, warmup, WSD decay (scaled to TRAIN_ITERS)

run_pretrain \
    --num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12 \
    --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --rotary-base 10000 \
    --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
    --micro-batch-size "${MICRO_BATCH_SIZE:-8}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style WSD --lr-wsd-decay-style exponential \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-wsd-decay-iters "$WSD_DECAY_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --model-running-mode difflm-noshift --attention-mask-type no_mask \
    --difflm-eps 1e-3 --difflm-t-sampling antithetic --difflm-loss-weight inverse_p \
    --difflm-loss-normalizer tokens --difflm-varilen-prob 0.01 \
    --eval-interval 1000 --eval-iters 10
