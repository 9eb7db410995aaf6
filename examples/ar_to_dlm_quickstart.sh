#!/usr/bin/env bash
# AR-to-DLM adaptation on CPU, in the quickstart's style (no downloads, no GPU): the quickstart's
# autoregressive model (MODE=vanilla, trained first if runs/quickstart-vanilla/ckpt is missing) becomes a
# block-diffusion DLM with the 2026 recipe at toy scale: a block-size curriculum (LLaDA 2.0's
# warmup-stable-decay shape: blocks grow to the whole sequence, then come back down), the joint AR + DLM
# loss (the clean half stays an AR model) and, optionally, confidence-aware training. Then it samples the
# adapted model both ways: by block diffusion and token by token.
#   bash examples/ar_to_dlm_quickstart.sh
#   CONFIDENCE_LOSS_WEIGHT=0.5 bash examples/ar_to_dlm_quickstart.sh   # + LLaDA 2.0's CAP loss
# Knobs: NPROC (2), AR_ITERS (100: the AR model's run, when it is trained here), TRAIN_ITERS (60: the
# adaptation), AR_LOSS_WEIGHT (1.0), BLOCK_SCHEDULE (0:4,10:16,20:128,50:16 at 60 iterations: scaled with
# TRAIN_ITERS), DATA_DIR (runs/data); extra flags pass through to the adaptation.
# The 1.7B recipe on GPUs: examples/dlm_training/ar_to_dlm_1.7b.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
AR_ITERS=${AR_ITERS:-100}
TRAIN_ITERS=${TRAIN_ITERS:-60}
DATA_DIR=${DATA_DIR:-runs/data}
AR_CKPT=runs/quickstart-vanilla/ckpt
DLM_CKPT=runs/ar-to-dlm/ckpt
TOKENIZER=examples/data/tokenizer/spm_8k.model

if [[ ! -f "$AR_CKPT/latest_checkpointed_iteration.txt" ]]; then
    TRAIN_ITERS=$AR_ITERS MODE=vanilla NPROC=$NPROC DATA_DIR=$DATA_DIR bash examples/quickstart.sh
fi
# The curriculum's iterations scale with TRAIN_ITERS (an entry landing on an earlier one's iteration
# replaces it); seq 128 is one block at 128, plain MDLM.
SCHEDULE=${BLOCK_SCHEDULE:-$(python - "$TRAIN_ITERS" <<'PY'
import sys
train, entries = int(sys.argv[1]), {}
for first, size in ((0, 4), (10, 16), (20, 128), (50, 16)):
    entries[first * train // 60] = size
print(",".join(f"{first}:{size}" for first, size in sorted(entries.items())))
PY
)}
CAP=()
if [[ -n "${CONFIDENCE_LOSS_WEIGHT:-}" ]]; then CAP=(--difflm-confidence-loss-weight "$CONFIDENCE_LOSS_WEIGHT"); fi

rm -rf "$DLM_CKPT"
ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu \
    --qk-layernorm --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters $(( TRAIN_ITERS / 10 )) --lr-decay-style cosine --weight-decay 0.0 \
    --data-path "$DATA_DIR/sotu_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --load "$AR_CKPT" --finetune --save "$DLM_CKPT" \
    --model-running-mode difflm-noshift --difflm-block-diffusion --difflm-block-size-schedule "$SCHEDULE" \
    --difflm-ar-loss-weight "${AR_LOSS_WEIGHT:-1.0}" ${CAP[@]+"${CAP[@]}"} --difflm-t-sampling antithetic \
    --log-interval 5 --eval-interval 30 --eval-iters 2 \
    --tensorboard-dir "${TENSORBOARD_DIR:-runs/ar-to-dlm}" "$@")
if [[ "${CHECK_ARGS:-1}" != 0 ]]; then
    WORLD_SIZE="$NPROC" python pretrain_difflm.py --check-args "${ARGS[@]}"
fi
torchrun --standalone --nproc_per_node="$NPROC" pretrain_difflm.py "${ARGS[@]}"

PROMPT="Fellow-Citizens of the Senate"
echo "> block diffusion (the blocks it ended with):"
python examples/dlm_generation/dlm_inference.py --load "$DLM_CKPT" --prompt "$PROMPT" --max-new-tokens 32 \
    --sample-steps 32
echo "> token by token (its clean half is an AR model):"
python examples/dlm_generation/dlm_inference.py --load "$DLM_CKPT" --prompt "$PROMPT" --max-new-tokens 32 \
    --autoregressive
