#!/usr/bin/env bash
# 1.7B autoregressive LM, the same shape as examples/dlm_training/dlm_pretrain_1.7b.sh, causal. The
# output layer and cross-entropy run in chunks without fp32 logits, compiled (--difflm-masked-only-loss
# --difflm-compile-loss: in vanilla mode every loss position), as in the DLM script: 470 TFLOP/s on one
# H200 against 435 without them (docs/performance_history.md). Adam's moments in bf16 (Megatron's precision-aware
# optimizer): 196.5 -> 193.7 ms a step (496 TFLOP/s, 1.82x a Hugging Face step) and 6.5 GiB less memory.
# bf16 working copies of the weights, written by the compiled optimizer step
# (--cache-low-precision-weights): -1.5 ms a step, measured side by side.
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-ar_1.7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 500000 2000  # iterations: run, warmup (scaled to TRAIN_ITERS)

run_pretrain \
    "${QWEN3_1P7B_SHAPE[@]}" \
    --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --compile-optimizer-step \
    --cache-low-precision-weights \
    --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
    --model-running-mode vanilla \
    --difflm-masked-only-loss --difflm-compile-loss --torch-compile \
    --eval-interval 2000 --eval-iters 10
