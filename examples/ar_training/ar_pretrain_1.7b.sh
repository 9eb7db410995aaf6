#!/usr/bin/env bash
# 1.7B autoregressive LM, the same shape as examples/dlm_training/dlm_pretrain_1.7b.sh, causal. The
# output layer and cross-entropy run in chunks without fp32 logits, compiled (--difflm-masked-only-loss
# --difflm-compile-loss: in vanilla mode every loss position), as in the DLM script: 470 TFLOP/s on one
# H200 against 435 without them (docs/performance.md).
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-ar_1.7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

run_pretrain \
    --num-layers 28 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16 \
    --group-query-attention --num-query-groups 8 --kv-channels 128 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
    --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "${TRAIN_ITERS:-500000}" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --model-running-mode vanilla \
    --difflm-masked-only-loss --difflm-compile-loss --torch-compile \
    --eval-interval 2000 --eval-iters 10
