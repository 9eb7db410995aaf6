#!/usr/bin/env bash
# The built-in default: tokenize the bundled corpus (State of the Union addresses 1790-1928,
# public domain, examples/data/) with the bundled SentencePiece tokenizer, then train a small
# diffusion LM on it with 2 CPU processes (gloo). No downloads, no GPU.
#   bash examples/quickstart.sh                 # difflm-noshift, bidirectional attention
#   MODE=vanilla bash examples/quickstart.sh    # the same model trained autoregressively
#   MOCK_DATA=1 bash examples/quickstart.sh     # synthetic documents instead of the corpus
# Other knobs: NPROC (2), TRAIN_ITERS (100; up to 20 the warmup is half of it), DATA_DIR (runs/data), TENSORBOARD_DIR,
# CHECK_ARGS (1: validate the flags before torchrun); extra flags pass through.
# Without extra flags the run is saved to runs/quickstart-$MODE/ckpt and a sample is generated from it.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-100}
WARMUP=$(( TRAIN_ITERS > 20 ? 10 : TRAIN_ITERS / 2 ))  # the warmup must end before the decay does
MODE=${MODE:-difflm-noshift}
DATA_DIR=${DATA_DIR:-runs/data}
TOKENIZER=examples/data/tokenizer/spm_8k.model

if [[ -n "${MOCK_DATA:-}" ]]; then
    DATA_ARGS=(--mock-data --vocab-size 512 --add-mask-token)
else
    PREFIX="$DATA_DIR/sotu_text_document"
    if [[ ! -f "$PREFIX.idx" ]]; then
        python tools/preprocess_data.py --input examples/data/sotu_1790_1928.jsonl.gz \
            --output-prefix "$DATA_DIR/sotu" --tokenizer-type SentencePieceTokenizer \
            --tokenizer-model "$TOKENIZER" --append-eod --workers "$NPROC"
    fi
    DATA_ARGS=(--data-path "$PREFIX" --split 98,2,0
               --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER")
fi

SAMPLE_ARGS=()
CKPT_DIR="runs/quickstart-$MODE/ckpt"
if [[ $# -eq 0 && -z "${MOCK_DATA:-}" ]]; then
    rm -rf "$CKPT_DIR"
    SAMPLE_ARGS=(--save "$CKPT_DIR")
fi

ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu \
    --qk-layernorm --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters "$WARMUP" --lr-decay-style cosine --weight-decay 0.0 \
    "${DATA_ARGS[@]}" \
    --model-running-mode "$MODE" --attention-mask-type no_mask --difflm-t-sampling antithetic \
    --log-interval 1 --log-throughput --eval-interval 50 --eval-iters 2 \
    --tensorboard-dir "${TENSORBOARD_DIR:-runs/quickstart-$MODE}" ${SAMPLE_ARGS[@]+"${SAMPLE_ARGS[@]}"} "$@")
# The flags are validated once before torchrun starts its workers (CHECK_ARGS=0 skips it): a bad flag
# is then one line, not a line per worker and torchrun's failure report.
if [[ "${CHECK_ARGS:-1}" != 0 ]]; then
    WORLD_SIZE="$NPROC" python pretrain_difflm.py --check-args "${ARGS[@]}"
fi
torchrun --standalone --nproc_per_node="$NPROC" pretrain_difflm.py "${ARGS[@]}"

if [[ ${#SAMPLE_ARGS[@]} -gt 0 ]]; then
    python examples/dlm_generation/dlm_inference.py --load "$CKPT_DIR" --prompt "Fellow-Citizens of the Senate" \
        --max-new-tokens 32 --sample-steps 32 --inference-block-size 32
fi
