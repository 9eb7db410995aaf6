#!/usr/bin/env bash
# Shared by the launch scripts: torchrun topology, data, logging and checkpoint flags, all
# from environment variables, so one script serves a laptop, a node and a SLURM allocation.
#
#   GPUS_PER_NODE (default: all visible GPUs, or 1)  NNODES (1)  NODE_RANK (0)
#   MASTER_ADDR (localhost)  MASTER_PORT (6000)
#   DATA_PATH        weighted .bin/.idx prefixes; empty = synthetic --mock-data
#   TOKENIZER_MODEL  tokenizer folder / tokenizer.json / .model for DATA_PATH runs
#   MOCK_VOCAB_SIZE  vocabulary of --mock-data runs (default 151936, Qwen's)
#   CHECKPOINT_PATH  --save/--load directory (async saves every SAVE_INTERVAL, default 1000 iterations,
#                    and one on SIGTERM); empty = no checkpoints
#   TENSORBOARD_DIR  tensorboard event files (default runs/$RUN_NAME)
#   TRAIN_ITERS, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, LR_WARMUP_ITERS, WSD_DECAY_ITERS, LOG_INTERVAL
#                    override the script's values (short smoke runs). Unset, the warmup and the WSD decay
#                    follow TRAIN_ITERS (lr_schedule below): TRAIN_ITERS=25 alone is a valid smoke run
#   EXTRA_ARGS       appended verbatim (e.g. "--attention-backend flex")
#   CHECK_ARGS       1 (default): the flags are validated once (pretrain_difflm.py --check-args) before
#                    torchrun starts, so a bad flag is one line; 0 skips that (a few seconds of start-up)
#   BLOCK_SCHEDULE   a block-size curriculum (ITER:SIZE,...) replacing the script's (block_schedule below)
#   CHECK_ONLY       1: validate the flags for GPUS_PER_NODE x NNODES ranks and stop before torchrun (no
#                    GPU needed: check a layout on a laptop before it queues on a cluster)
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-1}
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path $DATA_PATH --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL for DATA_PATH runs}" --split 949,50,1)
else
    DATA_ARGS=(--mock-data --vocab-size "${MOCK_VOCAB_SIZE:-151936}" --add-mask-token)
fi

CHECKPOINT_ARGS=()
if [[ -n "${CHECKPOINT_PATH:-}" ]]; then
    CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-1000}"
                     --async-save --exit-signal-handler)
fi

LOGGING_ARGS=(--log-interval "${LOG_INTERVAL:-10}" --log-throughput
              --tensorboard-dir "${TENSORBOARD_DIR:-$ROOT_DIR/runs/$RUN_NAME}")

# The Qwen3-1.7B shape the 1.7B scripts share (DLM, AR and SFT): 28 layers, hidden 2048, 16 heads / 8 kv
# heads of 128, SwiGLU 6144, RMSNorm 1e-6, QK-norm, RoPE base 1e6, tied embeddings, seq 4096.
QWEN3_1P7B_SHAPE=(--num-layers 28 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16
                  --group-query-attention --num-query-groups 8 --kv-channels 128
                  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
                  --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu
                  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02)

# lr_schedule TRAIN WARMUP [WSD_DECAY]: the script's default run length, warmup and WSD decay (iterations).
# Sets TRAIN_ITERS, LR_WARMUP_ITERS and WSD_DECAY_ITERS where the environment leaves them unset: the
# script's values at its default length; at another TRAIN_ITERS the warmup is at most a tenth of the run
# and the decay keeps its share of it (at least 1), so the warmup ends before the decay does
# (TRAIN_ITERS=25 with the 1.7B script: warmup 2, decay 2).
lr_schedule() {
    local default_train=$1 default_warmup=$2 default_decay=${3:-0}
    TRAIN_ITERS=${TRAIN_ITERS:-$default_train}
    if [[ ! "$TRAIN_ITERS" =~ ^[1-9][0-9]*$ ]]; then
        echo "TRAIN_ITERS=$TRAIN_ITERS is not a positive number of iterations; set it to one (e.g. TRAIN_ITERS=25)" >&2
        exit 2
    fi
    local tenth=$(( TRAIN_ITERS / 10 )) share=$(( default_decay * TRAIN_ITERS / default_train ))
    LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( default_warmup < tenth ? default_warmup : tenth ))}
    WSD_DECAY_ITERS=${WSD_DECAY_ITERS:-$(( share > 0 ? share : 1 ))}
}

# block_schedule TRAIN ITER:SIZE,...: a block-size curriculum written for a TRAIN-iteration run, its
# iterations scaled to TRAIN_ITERS (an entry landing on an earlier one's iteration replaces it), in
# BLOCK_SCHEDULE unless the environment sets it (then it is used as given).
block_schedule() {
    local default_train=$1 entry first size
    if [[ -n "${BLOCK_SCHEDULE:-}" ]]; then return 0; fi
    local -a firsts=() sizes=()
    IFS=',' read -ra entries <<< "$2"
    for entry in "${entries[@]}"; do
        first=$(( ${entry%%:*} * TRAIN_ITERS / default_train )) size=${entry##*:}
        if (( ${#firsts[@]} > 0 && firsts[-1] == first )); then
            sizes[-1]=$size
        else
            firsts+=("$first") sizes+=("$size")
        fi
    done
    BLOCK_SCHEDULE=""
    for index in "${!firsts[@]}"; do
        BLOCK_SCHEDULE+="${BLOCK_SCHEDULE:+,}${firsts[$index]}:${sizes[$index]}"
    done
}

# run_pretrain ARG...: torchrun ENTRY (default pretrain_difflm.py; posttrain_rl.py for RL) with the shared flags
# and the script's own.
run_pretrain() {
    cd "$ROOT_DIR"
    local entry=${ENTRY:-pretrain_difflm.py}
    # shellcheck disable=SC2206
    local args=("$@" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" ${CHECKPOINT_ARGS[@]+"${CHECKPOINT_ARGS[@]}"} ${EXTRA_ARGS:-})
    if [[ "${CHECK_ARGS:-1}" != 0 || "${CHECK_ONLY:-0}" == 1 ]]; then
        WORLD_SIZE=$(( GPUS_PER_NODE * NNODES )) python "$entry" --check-args "${args[@]}"
    fi
    if [[ "${CHECK_ONLY:-0}" == 1 ]]; then
        echo "> the flags hold for $(( GPUS_PER_NODE * NNODES )) ranks (CHECK_ONLY=1: not launched)"
        return 0
    fi
    torchrun "${DISTRIBUTED_ARGS[@]}" "$entry" "${args[@]}"
}
