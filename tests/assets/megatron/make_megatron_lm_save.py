"""Make a checkpoint as Megatron-LM's training saves one: its own `megatron.training.checkpointing.save_checkpoint`
(torch_dist: `common.pt` with the whole run's args, `metadata.json` and the content metadata this release records;
or the legacy torch format) of its megatron-core GPT (local layer spec), with the logits it computes.

make_assets.py builds megatron-core's model from the wheel and writes the common.pt itself (a subset of the args);
this goes through Megatron-LM's training code (parse_args, validate_args, save_checkpoint), so the files carry what
a real run records (about 740 args, enum and signal members among them). It runs on the Megatron-LM tree 4e4b380
(megatron-core 0.18.0, the same as make_legacy_gpt.py's) in a Python 3.12 environment, from a folder outside this
repository:

    cd /tmp && CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=/tmp/mlm_old /tmp/v12/bin/torchrun --nproc-per-node 1 \\
        REPO/tests/assets/megatron/make_megatron_lm_save.py --out REPO/tests/assets/megatron [--ckpt-format torch]

On CPU (gloo; megatron_lm_tree.py beside it says what is replaced).
Writes `megatron_lm_<format>/` with `logits.pt` ({"tokens", "logits"}, full vocabulary).
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_lm_tree import causal_logits, megatron_args, perturbed, run_on_cpu, start_parallel_state

run_on_cpu()
VOCAB = 64
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--max-position-embeddings", "32", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--vocab-size", str(VOCAB),
         "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "NullTokenizer", "--use-cpu-initialization",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-masked-softmax-fusion",
         "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
         "--transformer-impl",
         "local", "--attention-backend", "unfused", "--distributed-backend", "gloo", "--no-save-optim",
         "--no-save-rng", "--lr", "1e-4", "--train-iters", "1", "--save-interval", "1"]


def build(args: argparse.Namespace):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(1234)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return perturbed(GPTModel(core_transformer_config_from_args(args), spec, VOCAB, args.max_position_embeddings,
                              position_embedding_type="rope"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    folder = os.path.join(options.out, f"megatron_lm_{options.ckpt_format}")
    args = megatron_args([*FLAGS, "--save", folder, "--ckpt-format", options.ckpt_format], VOCAB)
    start_parallel_state()
    from megatron.training.checkpointing import save_checkpoint

    model = build(args)
    save_checkpoint(1, [model], None, None, num_floating_point_operations_so_far=0)
    torch.save(causal_logits(model, VOCAB, 16), os.path.join(folder, "logits.pt"))
    with open(os.path.join(folder, "made_by.txt"), "w") as handle:
        handle.write(f"Megatron-LM 4e4b380 (megatron-core 0.18.0) save_checkpoint, torch {torch.__version__}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
