#!/usr/bin/env bash
# RL on a real model: SmolLM2-135M adapted into a DLM by dlm_recipes.sh (arm DLM_ARM, default mdlm: the
# trained-generation benchmark's shift MDLM), fine-tuned on 4x4 Sudoku, then trained by posttrain_rl.py with
# d1's diffu_grpo and with SPG; beside them the AR twin (the same network as itself, fine-tuned the same way)
# with GRPO, the reference (docs/rl.md, "On a real model"). A block-diffusion arm (curriculum, joint) takes
# ar_order_grpo, the estimator exact for it.
#
#   tools/benchmark/dlm_rl.sh prepare               # CPU: Sudoku SFT records and RL tasks, tokenized with $WORK/hf
#   tools/benchmark/dlm_rl.sh sft [dlm] [ar]        # GPU: adapt (if not done) and fine-tune the DLM; the AR twin
#   tools/benchmark/dlm_rl.sh rl NAME ALGORITHM     # GPU: NAME dlm or ar; held-out reward, then RL_ITERS steps
#                                                   # (logs RUN.log and RUN.before.log, RUN default NAME_ALGORITHM)
#   tools/benchmark/dlm_rl.sh measure               # the table of every run in $RESULTS (rl_table.py)
#   tools/benchmark/dlm_rl.sh speed                 # GPU: rollout speed of the fine-tuned policies, eager and
#                                                   # CUDA-graph rollouts, the DLM at 32 and 16 steps ($RESULTS/speed)
#
# WORK as dlm_recipes.sh's (the converted model $WORK/hf; the adaptation $WORK/recipe_$DLM_ARM); results and logs
# in RESULTS (default $WORK/rl). Sudoku: SFT_COUNT (20,000) fine-tuning records, SFT_ITERS (300: short, so the
# policy leaves room to learn), RL_COUNT (4,000) training tasks, EVAL_PROMPTS (256) held out, each drawn by
# tools/build_rl_task.py from its own seed; fine-tuning rows of SFT_SEQ_LENGTH (192: a Sudoku example is 144
# tokens), RL rows of RL_SEQ_LENGTH (256) positions. The RL tasks' reward is REWARD (sudoku_cells: d1's share
# of the blanks filled right; sudoku: 1 for a solution), the held-out one VALID_REWARD (sudoku: the share
# solved). Each RL step: PROMPTS (16) prompts x GROUP_SIZE (8) completions of GEN_LENGTH (32) tokens at
# temperature 1 (the DLM one token a step, block 32; SAMPLING_STEPS fewer steps; CUDA graphs unless
# CUDA_GRAPHS=0), INNER_STEPS (1; d1 takes 12) updates clipped at CLIP_LOW / CLIP_HIGH (0.2 / 0.28; d1: 0.5)
# on each step's rollouts at RL_LR (1e-5; d1: 3e-6) constant with KL_BETA (0.04, d1's) times the KL to the
# fine-tuned policy (frozen; 0: none; SPG takes none), advantages over the group's std (SPG: its Sudoku recipe,
# centred advantages, upper-bound beta 1, rollouts at temperature 0.3); RL_ITERS (100; a multiple of
# INNER_STEPS) updates, MICRO_BATCH_SIZE (32). The held-out reward is greedy, before (--skip-train) and after,
# with its first 4 completions in the log. Three runs go side by side on one 80 GB card (two DLM runs held
# 47 GB; five ran out of memory); each torchrun picks its own port: give each its RUN name.
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK=${WORK:-/tmp/trained_generation}
RESULTS=${RESULTS:-$WORK/rl}
PYTHON=${PYTHON:-python}
DLM_ARM=${DLM_ARM:-mdlm}
MASK_TOKEN=16  # dlm_recipes.sh's
GROUP_SIZE=${GROUP_SIZE:-8}
RL_ITERS=${RL_ITERS:-100}
cd "$ROOT_DIR"

prepare() {
    mkdir -p "$WORK/data"
    "$PYTHON" tools/build_rl_task.py --kind sudoku --count "${SFT_COUNT:-20000}" --seed 11 --sft --force \
        --output "$WORK/sudoku_train.jsonl.gz"
    "$PYTHON" tools/build_rl_task.py --kind sudoku --count 500 --seed 12 --sft --force --output "$WORK/sudoku_valid.jsonl.gz"
    "$PYTHON" tools/build_rl_task.py --kind sudoku --count "${RL_COUNT:-4000}" --seed 13 --force \
        --reward "${REWARD:-sudoku_cells}" --output "$WORK/sudoku_rl_train.jsonl.gz"
    "$PYTHON" tools/build_rl_task.py --kind sudoku --count "${EVAL_PROMPTS:-256}" --seed 14 --force \
        --reward "${VALID_REWARD:-sudoku}" --output "$WORK/sudoku_rl_valid.jsonl.gz"
    for split in train valid; do
        "$PYTHON" tools/preprocess_data.py --input "$WORK/sudoku_$split.jsonl.gz" --chat \
            --output-prefix "$WORK/data/sudoku_$split" --tokenizer-type HuggingFaceTokenizer \
            --tokenizer-model "$WORK/hf" --workers 2
    done
}

# recipes ARGS...: dlm_recipes.sh with this script's task and its fine-tuning length.
recipes() {
    SFT_TASK=sudoku SFT_ITERS=${SFT_ITERS:-300} SFT_SEQ_LENGTH=${SFT_SEQ_LENGTH:-192} bash tools/benchmark/dlm_recipes.sh "$@"
}

sft() {
    local names=("$@")
    [[ ${#names[@]} -eq 0 ]] && names=(dlm ar)
    for name in "${names[@]}"; do
        if [[ $name == ar ]]; then recipes train ar; continue; fi
        [[ -f $WORK/recipe_$DLM_ARM/latest_checkpointed_iteration.txt ]] || recipes adapt "$DLM_ARM"
        recipes sft "$DLM_ARM"
    done
}

# policy NAME: the fine-tuned checkpoint RL starts from.
policy() { if [[ $1 == ar ]]; then echo "$WORK/recipe_ar_sft_sudoku"; else echo "$WORK/recipe_${DLM_ARM}_sft_sudoku"; fi; }

# posttrain NAME ALGORITHM FLAGS...: posttrain_rl.py on NAME's policy.
posttrain() {
    local prompts=${PROMPTS:-16} objective=() graphs=() temperature=1.0
    if [[ $2 == spg ]]; then  # SPG's Sudoku recipe: no KL term, advantages centred only, beta 1, temperature 0.3
        objective=(--rl-advantage dr_grpo --rl-spg-beta 1.0) temperature=0.3
    elif [[ ${KL_BETA:-0.04} != 0 ]]; then
        objective=(--rl-kl-beta "${KL_BETA:-0.04}" --rl-reference "$(policy "$1")")
    fi
    if [[ ${CUDA_GRAPHS:-1} != 0 ]]; then graphs=(--rl-cuda-graphs); fi
    torchrun --standalone --nproc-per-node 1 posttrain_rl.py --load "$(policy "$1")" --finetune --use-checkpoint-args \
        --no-load-optim --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/hf" --mask-token "$MASK_TOKEN" \
        --rl-task "$WORK/sudoku_rl_train.jsonl.gz" --rl-valid-task "$WORK/sudoku_rl_valid.jsonl.gz" \
        --rl-eval-prompts "${EVAL_PROMPTS:-256}" --rl-log-completions 4 --rl-algorithm "$2" \
        --rl-group-size "$GROUP_SIZE" \
        --rl-gen-length "${GEN_LENGTH:-32}" --rl-temperature "$temperature" --rl-clip-low "${CLIP_LOW:-0.2}" --rl-clip-high "${CLIP_HIGH:-0.28}" \
        --rl-reward-workers 4 --rl-inner-steps "${INNER_STEPS:-1}" --micro-batch-size "${MICRO_BATCH_SIZE:-32}" \
        --global-batch-size $(( prompts * GROUP_SIZE )) --train-iters "$RL_ITERS" --lr "${RL_LR:-1e-5}" \
        --min-lr "${RL_LR:-1e-5}" --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.99 \
        --clip-grad 1.0 --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 1 \
        --eval-interval "$RL_ITERS" --eval-iters 1 --seq-length "${RL_SEQ_LENGTH:-256}" --seed 1234 \
        "${objective[@]}" "${graphs[@]}" "${@:3}"
}

# sampler NAME: the DLM sampler's flags (none for the AR twin).
sampler() {
    [[ $1 == dlm || $1 == ar ]] || { echo "$0: NAME is dlm or ar, not $1" >&2; exit 2; }
    if [[ $1 == dlm ]]; then
        echo --rl-block-length 32 --rl-spg-samples 2
        [[ -z ${SAMPLING_STEPS:-} ]] || echo --rl-sampling-steps "$SAMPLING_STEPS"
    fi
}

rl() {
    local name=${1:?usage: rl NAME ALGORITHM} algorithm=${2:?usage: rl NAME ALGORITHM} dlm
    dlm=$(sampler "$name")
    local run=${RUN:-${name}_$algorithm}
    mkdir -p "$RESULTS"
    # shellcheck disable=SC2086 # the sampler's flags, split
    posttrain "$name" "$algorithm" --skip-train $dlm 2>&1 | tee "$RESULTS/$run.before.log"
    # shellcheck disable=SC2086
    posttrain "$name" "$algorithm" $dlm 2>&1 | tee "$RESULTS/$run.log"
}

# speed: SPEED_ITERS (6) RL steps of each policy per rollout setting, no KL term; the table of their median
# rollout tokens/s and step time (the first step, which captures the graphs, is one of six).
speed() {
    local runs=() arm name steps graphs algorithm
    mkdir -p "$RESULTS/speed"
    for arm in dlm:32:0 dlm:32:1 dlm:16:0 dlm:16:1 ar:-:0 ar:-:1; do
        IFS=: read -r name steps graphs <<< "$arm"
        algorithm=grpo; [[ $name == dlm ]] && algorithm=diffu_grpo
        local run=${name}_steps${steps}_graphs$graphs
        [[ $name == ar ]] && run=ar_graphs$graphs
        # shellcheck disable=SC2046
        RL_ITERS=${SPEED_ITERS:-6} KL_BETA=0 CUDA_GRAPHS=$graphs posttrain "$name" "$algorithm" \
            $(SAMPLING_STEPS=${steps/-/} sampler "$name") > "$RESULTS/speed/$run.log" 2>&1
        runs+=("$run")
    done
    "$PYTHON" tools/benchmark/rl_table.py --results "$RESULTS/speed" "${runs[@]}"
}

measure() {
    local runs=()
    for log in "$RESULTS"/*.log; do
        [[ $log == *.before.log ]] || runs+=("$(basename "$log" .log)")
    done
    "$PYTHON" tools/benchmark/rl_table.py --results "$RESULTS" "${runs[@]}"
}

stage=${1:-}
shift || true
case "$stage" in
    prepare | sft | rl | measure | speed) "$stage" "$@" ;;
    *) echo "usage: $0 prepare|sft|rl|measure|speed (see the header)" >&2; exit 2 ;;
esac
