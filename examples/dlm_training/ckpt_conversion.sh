#!/usr/bin/env bash
# Train -> convert to Hugging Face -> verify -> generate, on the bundled corpus with 2 CPU processes.
#   bash examples/dlm_training/ckpt_conversion.sh               # a small difflm-noshift DLM
#   MODE=vanilla bash examples/dlm_training/ckpt_conversion.sh  # AR: exported as a native Qwen3ForCausalLM
# For a checkpoint of your own: SKIP_TRAINING=1 CKPT_DIR=<its --save dir> TOKENIZER=<the --tokenizer-model it
# trained with> bash examples/dlm_training/ckpt_conversion.sh (DTYPE=bfloat16 for a compact export; verify it
# with TOLERANCE=1e-1, since bf16 rounds the weights).
# Knobs: CKPT_DIR, HF_DIR, TRAIN_ITERS (30), MODE (difflm-noshift), DTYPE (float32), TOLERANCE (1e-4), NPROC (2).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${MODE:-difflm-noshift}
CKPT_DIR=${CKPT_DIR:-runs/conversion-$MODE/ckpt}
HF_DIR=${HF_DIR:-runs/conversion-$MODE/hf}
TOKENIZER=${TOKENIZER:-examples/data/tokenizer/spm_8k.model}
DTYPE=${DTYPE:-float32}

# 1. Train (any tensor/data-parallel layout converts the same way) and save a checkpoint.
if [[ -z "${SKIP_TRAINING:-}" ]]; then
    MODE=$MODE TRAIN_ITERS=${TRAIN_ITERS:-30} TENSORBOARD_DIR="runs/conversion-$MODE/tb" \
        bash examples/quickstart.sh --save "$CKPT_DIR" --eval-iters 0 --log-interval 10
fi

# 2. Checkpoint -> Hugging Face: safetensors, config.json from the checkpoint's metadata, the training
#    tokenizer, and for DLMs the remote code (configuration_dlm.py, modeling_dlm.py, generation.py).
python tools/weights_conversion/megatron_to_hf.py --load "$CKPT_DIR" --save "$HF_DIR" --dtype "$DTYPE" \
    --tokenizer-model "$TOKENIZER"

# 3. Same real text through both models in the checkpoint's running mode: logits and loss must agree.
python tools/weights_conversion/verify_correctness_dlm.py --load "$CKPT_DIR" --hf-path "$HF_DIR" \
    --tokenizer-model "$TOKENIZER" --tolerance "${TOLERANCE:-1e-4}"

# 4. Generate with transformers alone (the DLM sampler ships with the export).
python - "$HF_DIR" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # v5 reads config.json too
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
prompt = tokenizer(["Fellow-Citizens of the Senate and House of Representatives:"], return_tensors="pt")
if getattr(model.config, "model_running_mode", "vanilla") == "vanilla":
    output = model.generate(**prompt, max_new_tokens=32, do_sample=False)
else:  # LLaDA-style semi-autoregressive sampling: 4 blocks of 8 tokens, one token per step
    output = model.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], gen_length=32,
                            steps=32, block_length=8, temperature=0.0)
print(f"> {type(model).__name__}: {tokenizer.decode(output[0], skip_special_tokens=True)!r}")
EOF

# 5. Back to a MegaDLMs checkpoint (here in a TP=2 layout; any layout loads it), e.g. to continue training with
#    `pretrain_difflm.py --load "$CKPT_DIR-from-hf" --finetune` and the same architecture flags.
rm -rf "$CKPT_DIR-from-hf"
python tools/weights_conversion/hf_to_megatron.py --hf-path "$HF_DIR" --save "$CKPT_DIR-from-hf" \
    --tensor-model-parallel-size 2
