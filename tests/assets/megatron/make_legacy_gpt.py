"""Make the pre-megatron-core GPT checkpoint the interop tests load: Megatron-LM's own legacy GPTModel
(`megatron/legacy/model`, `--use-legacy-models`; its `language_model.*` state dict), built by Megatron-LM and
saved in its legacy `torch` format, with the logits it computes for fixed token ids.

Megatron-LM removed that model in commit c59c4ea32e; this runs on the tree just before it (4e4b380, megatron-core
0.18.0), fetched from its public repository, in a Python 3.12 environment of its own, from a folder outside this
repository:

    git -C Megatron-LM archive 4e4b38023d373a08637beb38733e421f6f26008f megatron | tar -x -C /tmp/mlm_old
    python3.12 -m venv /tmp/v12 && /tmp/v12/bin/pip install torch==2.13.0 numpy packaging einops omegaconf psutil
    cd /tmp && CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=/tmp/mlm_old /tmp/v12/bin/torchrun --nproc-per-node 1 \\
        REPO/tests/assets/megatron/make_legacy_gpt.py --out REPO/tests/assets/megatron
    # the same weights saved by two tensor-parallel ranks: --nproc-per-node 2 --tensor-model-parallel-size 2

It runs on CPU (gloo; megatron_lm_tree.py beside it says what is replaced), and Transformer Engine and apex are
not needed: the model is the Llama style
(RMSNorm, SwiGLU, RoPE, untied; multi-head attention: the legacy attention's GQA reshape needs a contiguous
copy it does not make), whose legacy modules are plain torch. Writes `legacy_gpt_tp<T>_pp1/` (the
legacy format's `iter_0000001/mp_rank_TT/model_optim_rng.pt`) and its `logits.pt` ({"tokens", "logits"}, full
vocabulary). Each layout's weights are their own draw (the seed is per shard shape), so each has its logits.
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_lm_tree import causal_logits, megatron_args, perturbed, run_on_cpu, start_parallel_state

run_on_cpu()
ITERATION = 1
VOCAB = 64
FLAGS = ["--use-legacy-models", "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--normalization",
         "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--no-position-embedding", "--max-position-embeddings", "32",
         "--seq-length", "32", "--micro-batch-size", "1", "--vocab-size", str(VOCAB),
         "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "NullTokenizer", "--use-cpu-initialization",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-masked-softmax-fusion",
         "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
         "--transformer-impl", "local", "--attention-backend", "unfused", "--ckpt-format", "torch",
         "--distributed-backend", "gloo"]


def build(args: argparse.Namespace):
    from megatron.legacy.model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(1234)
    return perturbed(GPTModel(core_transformer_config_from_args(args), num_tokentypes=0, parallel_output=False,
                              pre_process=True, post_process=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    options = parser.parse_args()
    tp = options.tensor_model_parallel_size
    dist.init_process_group("gloo")
    args = megatron_args([*FLAGS, "--tensor-model-parallel-size", str(tp)], VOCAB)
    start_parallel_state(tp)
    from megatron.core import parallel_state

    model = build(args)
    folder = os.path.join(options.out, f"legacy_gpt_tp{tp}_pp1")
    rank = parallel_state.get_tensor_model_parallel_rank()
    rank_dir = os.path.join(folder, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(rank_dir, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint()}, os.path.join(rank_dir, "model_optim_rng.pt"))
    # the legacy model's RoPE table is --seq-length long: rows of that length
    logits = causal_logits(model, VOCAB, args.seq_length)
    if dist.get_rank() == 0:  # gathered over the tensor-parallel ranks (parallel_output=False)
        torch.save(logits, os.path.join(folder, "logits.pt"))
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(ITERATION))
        with open(os.path.join(folder, "made_by.txt"), "w") as handle:
            handle.write(f"Megatron-LM 4e4b380 (megatron-core 0.18.0), legacy GPTModel, torch {torch.__version__}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
