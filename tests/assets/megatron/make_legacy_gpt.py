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

It runs on CPU (gloo): the CUDA calls on its way are replaced (the current device, the model-parallel RNG
tracker's CUDA states; dropout is 0), and Transformer Engine and apex are not needed: the model is the Llama style
(RMSNorm, SwiGLU, RoPE, untied; multi-head attention: the legacy attention's GQA reshape needs a contiguous
copy it does not make), whose legacy modules are plain torch. Writes `legacy_gpt_tp<T>_pp1/` (the
legacy format's `iter_0000001/mp_rank_TT/model_optim_rng.pt`) and its `logits.pt` ({"tokens", "logits"}, full
vocabulary). Each layout's weights are their own draw (the seed is per shard shape), so each has its logits.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

torch.cuda.current_device = lambda: "cpu"
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


def megatron_args(tp: int) -> argparse.Namespace:
    from megatron.training import arguments
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    arguments.get_device_arch_version = lambda: 9  # a check of the CUDA device under tensor parallelism

    sys.argv = [sys.argv[0], *FLAGS, "--tensor-model-parallel-size", str(tp)]
    args = parse_args()
    from megatron.core.enums import ModelType

    args.padded_vocab_size, args.model_type = VOCAB, ModelType.encoder_or_decoder  # as pretrain() sets them
    validate_args(args)
    set_args(args)
    return args


def build(args: argparse.Namespace):
    from megatron.core import tensor_parallel
    from megatron.legacy.model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    tracker.fork = lambda *names, **kwargs: torch.random.fork_rng(devices=[])  # dropout is 0: CPU draws
    torch.manual_seed(1234)
    model = GPTModel(core_transformer_config_from_args(args), num_tokentypes=0, parallel_output=False,
                     pre_process=True, post_process=True)
    with torch.no_grad():  # legacy layers zero their biases and norms; give every tensor values
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel()))
                           * 0.02)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    options = parser.parse_args()
    tp = options.tensor_model_parallel_size
    dist.init_process_group("gloo")
    args = megatron_args(tp)
    from megatron.core import parallel_state

    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    parallel_state.initialize_model_parallel(tp, 1)
    init_num_microbatches_calculator(0, None, 1, 1, 1)  # the legacy transformer reads it in its forward
    model = build(args)
    folder = os.path.join(options.out, f"legacy_gpt_tp{tp}_pp1")
    rank = parallel_state.get_tensor_model_parallel_rank()
    rank_dir = os.path.join(folder, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(rank_dir, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint()}, os.path.join(rank_dir, "model_optim_rng.pt"))
    length = args.seq_length  # the legacy model's RoPE table is --seq-length long: rows of that length
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(length).expand(2, length)
    causal = torch.ones(1, 1, length, length, dtype=torch.bool).triu(1)  # True = masked out
    with torch.no_grad():
        logits = model(tokens, positions, causal).float()
    if dist.get_rank() == 0:  # gathered over the tensor-parallel ranks (parallel_output=False)
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(folder, "logits.pt"))
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(ITERATION))
        with open(os.path.join(folder, "made_by.txt"), "w") as handle:
            handle.write(f"Megatron-LM 4e4b380 (megatron-core 0.18.0), legacy GPTModel, torch {torch.__version__}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
