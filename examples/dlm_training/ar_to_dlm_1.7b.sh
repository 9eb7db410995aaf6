#!/usr/bin/env bash
# AR-to-DLM adaptation of a Qwen3-1.7B-shaped autoregressive model (the 2025-26 recipe: LLaDA 2.0, SDAR,
# Megatron-Bridge's Nemotron Diffusion): the AR weights imported from Hugging Face, then continued
# pretraining as a block-diffusion DLM with
# - a block-size curriculum in LLaDA 2.0's warmup-stable-decay shape: blocks of 1, 4, 32, 64 tokens, then
#   the whole 4096-token sequence (plain MDLM), then back to 32 for the decay (BLOCK_SCHEDULE overrides);
# - the joint AR + DLM loss: the clean half of [x_t ; x_0] stays a causal AR model with the next-token loss,
#   weighted AR_LOSS_WEIGHT (default 3.33: Megatron-Bridge's DLM 0.3 and AR 1.0, up to the learning rate), so
#   the model keeps decoding autoregressively (generate(autoregressive=True)) while it learns to denoise;
# - optionally LLaDA 2.0's confidence-aware loss (CONFIDENCE_LOSS_WEIGHT, e.g. 0.5; it reads the full
#   logits, so the masked-only loss is then off).
#   HF_MODEL           a Hugging Face Qwen3 (or Llama) folder, converted once to INIT_CHECKPOINT
#                      (default $HF_MODEL-megadlms: tools/weights_conversion/hf_to_megatron.py, noshift, mask
#                      token MASK_TOKEN, default 151669, the first id Qwen3's tokenizer never emits); the
#                      model's shape, vocabulary and tokenizer then come from it (--use-checkpoint-args).
#                      Unset: the same recipe from a random Qwen3-1.7B-shaped model (smoke runs).
#   DATA_PATH, TOKENIZER_MODEL (default HF_MODEL): the corpus; other variables: examples/launch_common.sh.
# A resumed run (CHECKPOINT_PATH holding a checkpoint) continues from CHECKPOINT_PATH, mid-curriculum.
RUN_NAME=${RUN_NAME:-ar_to_dlm_1.7b}
if [[ -n "${HF_MODEL:-}" ]]; then
    TOKENIZER_MODEL=${TOKENIZER_MODEL:-$HF_MODEL}
    if [[ -z "${DATA_PATH:-}" ]]; then  # mock data brings its own vocabulary, not the model's
        echo "HF_MODEL=$HF_MODEL needs DATA_PATH: a corpus tokenized with its tokenizer (tools/preprocess_data.py)" >&2
        exit 2
    fi
fi
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 20000 500 2000  # iterations: run, warmup, WSD decay (scaled to TRAIN_ITERS)
block_schedule 20000 "0:1,400:4,800:32,1200:64,1600:4096,18000:32"

MODEL_ARGS=("${QWEN3_1P7B_SHAPE[@]}")
if [[ -n "${HF_MODEL:-}" ]]; then
    INIT_CHECKPOINT=${INIT_CHECKPOINT:-$HF_MODEL-megadlms}
    if [[ -e "$INIT_CHECKPOINT" && ! -f "$INIT_CHECKPOINT/latest_checkpointed_iteration.txt" ]]; then
        echo "INIT_CHECKPOINT=$INIT_CHECKPOINT exists but holds no checkpoint; remove it or point INIT_CHECKPOINT" \
             "elsewhere" >&2
        exit 2
    fi
    if [[ ! -f "$INIT_CHECKPOINT/latest_checkpointed_iteration.txt" && "${CHECK_ONLY:-0}" != 1 ]]; then
        # converted beside it, then renamed: a conversion that dies half-way leaves no half checkpoint behind
        rm -rf "$INIT_CHECKPOINT.new"
        python "$ROOT_DIR/tools/weights_conversion/hf_to_megatron.py" --hf-path "$HF_MODEL" \
            --save "$INIT_CHECKPOINT.new" --model-running-mode difflm-noshift --mask-token-id "${MASK_TOKEN:-151669}"
        mv "$INIT_CHECKPOINT.new" "$INIT_CHECKPOINT"
    fi
    if [[ -z "${CHECKPOINT_PATH:-}" || ! -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]]; then
        MODEL_ARGS=(--load "$INIT_CHECKPOINT" --finetune --use-checkpoint-args --seq-length 4096
                    --attention-dropout 0.0 --hidden-dropout 0.0)
        CHECKPOINT_ARGS=(${CHECKPOINT_PATH:+--save "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-1000}"})
    fi
fi
LOSS_ARGS=(--difflm-masked-only-loss --difflm-compile-loss)
if [[ -n "${CONFIDENCE_LOSS_WEIGHT:-}" ]]; then
    LOSS_ARGS=(--difflm-confidence-loss-weight "$CONFIDENCE_LOSS_WEIGHT")
fi

run_pretrain \
    "${MODEL_ARGS[@]}" \
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-128}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 2e-5 --min-lr 2e-6 --lr-decay-style WSD --lr-wsd-decay-style exponential \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --lr-wsd-decay-iters "$WSD_DECAY_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --compile-optimizer-step \
    --model-running-mode difflm-noshift --difflm-block-diffusion --difflm-block-size-schedule "$BLOCK_SCHEDULE" \
    --difflm-ar-loss-weight "${AR_LOSS_WEIGHT:-3.33}" \
    --difflm-eps 1e-3 --difflm-t-sampling antithetic --difflm-loss-weight inverse_p --difflm-loss-normalizer tokens \
    "${LOSS_ARGS[@]}" --torch-compile \
    --eval-interval 1000 --eval-iters 10
