#!/usr/bin/env bash
# RL with verifiable rewards for a Qwen3-1.7B-shaped DLM (posttrain_rl.py): d1's diffu-GRPO by default, on 8
# GPUs as 8 data-parallel replicas (ZeRO-1), each sampling its prompts' completions with the model's own
# sampler. Each step: GLOBAL_BATCH_SIZE (256) completions = 32 prompts x GROUP_SIZE (8), GEN_LENGTH (256)
# tokens each, block length 32, temperature 1, then one clipped update (DAPO's clip 0.2 / 0.28).
#   POLICY         the policy checkpoint (ours: e.g. ar_to_dlm_1.7b.sh's, fine-tuned; or an HF import by
#                  tools/weights_conversion/hf_to_megatron.py); its shape and mode come with it
#                  (--use-checkpoint-args). Unset: a random Qwen3-1.7B-shaped DLM (smoke runs and CHECK_ONLY).
#   TOKENIZER_MODEL  the policy's tokenizer (default: the bundled SentencePiece model, for smoke runs)
#   RL_TASK, RL_VALID_TASK  task files (megatron/rl/tasks.py); unset: Countdown ones built once under
#                  runs/rl_tasks by tools/build_rl_task.py
#   ALGORITHM      diffu_grpo (default), coupled_grpo, ar_order_grpo (block-diffusion policies) or grpo (AR)
# Other variables: examples/launch_common.sh (CHECKPOINT_PATH to save and resume).
RUN_NAME=${RUN_NAME:-dlm_grpo_1.7b}
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"
lr_schedule 500 10
ENTRY=posttrain_rl.py

TASKS="$ROOT_DIR/runs/rl_tasks"
if [[ -z "${RL_TASK:-}" ]]; then
    RL_TASK=$TASKS/countdown_train.jsonl RL_VALID_TASK=${RL_VALID_TASK:-$TASKS/countdown_valid.jsonl}
    if [[ ! -f $RL_TASK || ! -f $RL_VALID_TASK ]]; then
        mkdir -p "$TASKS"
        python "$ROOT_DIR/tools/build_rl_task.py" --kind countdown --count 20000 --seed 1 --output "$RL_TASK" --force
        python "$ROOT_DIR/tools/build_rl_task.py" --kind countdown --count 256 --seed 2 --output "$RL_VALID_TASK" \
            --force
    fi
fi
DATA_ARGS=(--tokenizer-type "${TOKENIZER_TYPE:-SentencePieceTokenizer}"
           --tokenizer-model "${TOKENIZER_MODEL:-$ROOT_DIR/examples/data/tokenizer/spm_8k.model}")
if [[ -n "${POLICY:-}" ]]; then
    MODEL_ARGS=(--load "$POLICY" --finetune --use-checkpoint-args --no-load-optim)
else
    MODEL_ARGS=("${QWEN3_1P7B_SHAPE[@]}" --model-running-mode difflm-noshift --attention-mask-type no_mask)
fi

run_pretrain \
    "${MODEL_ARGS[@]}" --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size "${MICRO_BATCH_SIZE:-8}" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --train-iters "$TRAIN_ITERS" --lr 1e-6 --min-lr 1e-6 --lr-decay-style constant \
    --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.99 --clip-grad 0.2 \
    --bf16 --data-parallel-sharding-strategy optim \
    --rl-task "$RL_TASK" ${RL_VALID_TASK:+--rl-valid-task "$RL_VALID_TASK"} --rl-eval-prompts 256 \
    --rl-algorithm "${ALGORITHM:-diffu_grpo}" --rl-group-size "${GROUP_SIZE:-8}" \
    --rl-gen-length "${GEN_LENGTH:-256}" --rl-block-length 32 --rl-temperature 1.0 \
    --rl-clip-low 0.2 --rl-clip-high 0.28 --rl-reward-workers 8 \
    --eval-interval 50 --eval-iters 1
