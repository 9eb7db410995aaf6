#!/usr/bin/env bash
# Supervised fine-tuning of the 1.7B masked diffusion LM (the shape of dlm_pretrain_1.7b.sh) on
# chat data, LLaDA's recipe: prompt never masked, answers EOD-padded to the row and trained,
# 1/p weights, each row divided by its answer length. Data: tools/preprocess_data.py --chat
# (DATA_PATH = the token prefix; the answer-mask pair sits beside it).
#   PRETRAINED_CHECKPOINT  where to start (our checkpoint, or tools/weights_conversion/hf_to_megatron.py's
#                          output); the first run loads it with --finetune, a resumed one
#                          (CHECKPOINT_PATH holds a checkpoint) continues from CHECKPOINT_PATH.
# Other environment variables: see examples/launch_common.sh.
RUN_NAME=${RUN_NAME:-dlm_sft_1.7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 5000 50  # iterations: run, warmup (scaled to TRAIN_ITERS)

START_ARGS=()
if [[ -z "${CHECKPOINT_PATH:-}" || ! -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]]; then
    if [[ -n "${PRETRAINED_CHECKPOINT:-}" ]]; then
        START_ARGS=(--load "$PRETRAINED_CHECKPOINT" --finetune)
        CHECKPOINT_ARGS=(${CHECKPOINT_PATH:+--save "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-500}"})
    fi
fi

run_pretrain \
    "${QWEN3_1P7B_SHAPE[@]}" \
    --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-64}" \
    --train-iters "$TRAIN_ITERS" \
    --lr 2.5e-5 --min-lr 2.5e-6 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --compile-optimizer-step \
    --model-running-mode difflm-noshift --attention-mask-type no_mask \
    --sft --sft-padding eos --sft-normalizer llada \
    --difflm-masked-only-loss --difflm-compile-loss --torch-compile \
    --eval-interval 500 --eval-iters 10 \
    ${START_ARGS[@]+"${START_ARGS[@]}"}
