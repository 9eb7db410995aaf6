#!/usr/bin/env bash
# 7B masked diffusion LM (Qwen2.5-7B / Dream shape): 28 layers, hidden 3584, 28 heads / 4 kv
# heads, SwiGLU 18944, QKV bias, RMSNorm 1e-6, RoPE base 1e6, untied embeddings, seq 4096.
# Layout for one node of 8 x 80 GB: TP=2 (+SP) x PP=2 x DP=2 with ZeRO-1 (TP, PP: environment).
# Estimated per GPU (7.6B / (TP x PP) = 1.9B parameters): fp32 weights and gradients 15.2 GB, AdamW
# state 15.2 GB / DP = 7.6 GB, activations with selective recompute about 34*s*h/TP bytes a layer
# (0.25 GB) x 14 layers x at most 2 micro-batches in flight on stage 0 = 7 GB: about 30 GB plus
# buffers and the output layer's chunks. (An estimate; measured runs go to docs/performance.md.)
# The fused loss (--difflm-compile-loss) also runs under TP (two Triton kernels and an all-gather per
# chunk); not yet measured on several GPUs, so add it through EXTRA_ARGS.
# --compile-optimizer-step: 551.4 -> 571.7 TFLOP/s at this shape on one H200 (docs/performance_history.md); Adam's
# moments in bf16 (precision-aware optimizer, works with ZeRO-1): 594.7 -> 601.0 and 4 bytes a parameter less.
# bf16 working copies of the weights (--cache-low-precision-weights), cast once an optimizer step: at 4
# micro-batches a step on one H200 804.4 -> 791.6 ms; under --fp8-format they are float8 copies, 641.3 -> 609.5 ms
# against torchao's float8 linears (fp8 1.30x our bf16 there; docs/performance_history.md). They also run under this
# layout's TP=2 (checked on gloo, not yet timed on several GPUs). fp8: EXTRA_ARGS="--fp8-format hybrid
# --fp8-recipe delayed" (Megatron's recipe; its casts are one Triton pass, SwiGLU's fused into them: 1.292x our
# bf16 on an H100 against tensorwise's 1.24x, its 200-step loss curve within 0.5% of bf16's).
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-dlm_7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 250000 2000 25000  # iterations: run, warmup, WSD decay (scaled to TRAIN_ITERS)
TP=${TP:-2}
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "${PP:-2}" --use-distributed-optimizer)
if (( TP > 1 )); then PARALLEL_ARGS+=(--sequence-parallel); fi

run_pretrain "${PARALLEL_ARGS[@]}" \
    --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 \
    --group-query-attention --num-query-groups 4 --kv-channels 128 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --add-qkv-bias \
    --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style WSD --lr-wsd-decay-style exponential \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-wsd-decay-iters "$WSD_DECAY_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --compile-optimizer-step \
    --cache-low-precision-weights \
    --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
    --recompute-granularity selective \
    --model-running-mode difflm-noshift --attention-mask-type no_mask \
    --difflm-eps 1e-3 --difflm-t-sampling antithetic --difflm-loss-weight inverse_p \
    --difflm-loss-normalizer tokens --difflm-masked-only-loss --torch-compile \
    --difflm-varilen-prob 0.01 \
    --eval-interval 2000 --eval-iters 10
