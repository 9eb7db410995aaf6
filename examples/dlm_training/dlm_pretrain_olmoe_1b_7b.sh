#!/usr/bin/env bash
# Mixture-of-experts masked diffusion LM, OLMoE-1B-7B shape (allenai/OLMoE-1B-7B-0924): 16 layers,
# hidden 2048, 16 heads of 128 (no GQA), every layer 64 routed experts of ffn 1024, top-8 with the
# softmax over all experts first, load-balancing loss 0.01 and router z-loss 0.001 (OLMoE's recipe),
# QK-norm, RMSNorm 1e-5, RoPE base 10000, untied embeddings, vocabulary 50,304, seq 4096.
# Experts run as grouped GEMMs; EP (environment, default 1) spreads them over the data-parallel
# ranks with the all-to-all dispatcher (EP must divide the GPUs and the 64 experts).
# One H200 measured this shape cut to 8 layers against transformers' OLMoE in docs/performance.md.
# Environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-dlm_olmoe_1b_7b}
MOCK_VOCAB_SIZE=${MOCK_VOCAB_SIZE:-50304}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 500000 2000 50000  # iterations: run, warmup, WSD decay (scaled to TRAIN_ITERS)
EP=${EP:-1}

run_pretrain \
    --num-layers 16 --hidden-size 2048 --ffn-hidden-size 1024 --num-attention-heads 16 --kv-channels 128 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000 \
    --normalization RMSNorm --norm-epsilon 1e-5 --qk-layernorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
    --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 --moe-router-pre-softmax \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 \
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --expert-model-parallel-size "$EP" \
    --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 4e-4 --min-lr 4e-5 --lr-decay-style WSD --lr-wsd-decay-style exponential \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-wsd-decay-iters "$WSD_DECAY_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --model-running-mode difflm-noshift --attention-mask-type no_mask \
    --difflm-eps 1e-3 --difflm-t-sampling antithetic --difflm-loss-weight inverse_p \
    --difflm-loss-normalizer tokens --difflm-masked-only-loss --difflm-compile-loss --torch-compile \
    --eval-interval 2000 --eval-iters 10
