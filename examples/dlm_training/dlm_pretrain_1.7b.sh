#!/usr/bin/env bash
# 1.7B masked diffusion LM (Qwen3-1.7B shape): 28 layers, hidden 2048, 16 heads / 8 kv heads,
# head dim 128, SwiGLU 6144, RMSNorm 1e-6, QK-norm, RoPE base 1e6, tied embeddings, seq 4096.
# --compile-optimizer-step: AdamW compiled per parameter, the clip folded in: 513.5 -> 519.5 TFLOP/s on one
# H200 (docs/performance_history.md); its first step compiles (about a minute).
# Adam's moments in bf16 (Megatron's precision-aware optimizer): 526.5 -> 535.2 TFLOP/s, 6.4 GiB less peak
# memory, the loss within 0.01% of fp32 moments over 150 CPU steps (docs/performance.md).
# bf16 working copies of the weights (--cache-low-precision-weights), cast once an optimizer step rather than
# in every micro-batch: at 4 micro-batches a step 784.5 -> 776.9 ms (548.9 -> 554.2 TFLOP/s).
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-dlm_1.7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 500000 2000 50000  # iterations: run, warmup, WSD decay (scaled to TRAIN_ITERS)

run_pretrain \
    "${QWEN3_1P7B_SHAPE[@]}" \
    --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style WSD --lr-wsd-decay-style exponential \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-wsd-decay-iters "$WSD_DECAY_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --compile-optimizer-step \
    --cache-low-precision-weights \
    --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
    --model-running-mode difflm-noshift --attention-mask-type no_mask \
    --difflm-eps 1e-3 --difflm-t-sampling antithetic --difflm-loss-weight inverse_p \
    --difflm-loss-normalizer tokens --difflm-masked-only-loss --difflm-compile-loss --torch-compile \
    --difflm-varilen-prob 0.01 \
    --eval-interval 2000 --eval-iters 10
