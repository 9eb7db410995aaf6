"""Megatron-LM's own training code loads a checkpoint tools/weights_conversion/to_megatron.py wrote, as
`pretrain_gpt.py --load DIR --finetune --use-checkpoint-args` does: its parse_args, load_args_from_checkpoint
(the architecture from our common.pt), validate_args, megatron-core's GPTModel (local layer spec) from those
args, and its load_checkpoint under --finetune. Then the loaded model's logits for fixed token ids go to
DIR/megatron_lm_logits.pt ({"tokens", "logits"}), to compare with ours.

The Megatron-LM tree and environment of make_megatron_lm_save.py (4e4b380, megatron-core 0.18.0, Python 3.12; the
newer main d98e8a6, megatron-core 0.20.0, runs it the same and gives the same logits), on CPU (gloo), from a folder
outside this repository:

    cd /tmp && CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=/tmp/mlm_old /tmp/v12/bin/torchrun --nproc-per-node 1 \\
        REPO/tests/assets/megatron/megatron_lm_loads_export.py --load EXPORT_DIR --vocab-size V
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_lm_tree import causal_logits, megatron_args, run_on_cpu, start_parallel_state

run_on_cpu()
FLAGS = ["--finetune", "--use-checkpoint-args", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "NullTokenizer", "--use-cpu-initialization",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-masked-softmax-fusion",
         "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
         "--transformer-impl", "local", "--attention-backend", "unfused", "--distributed-backend", "gloo",
         "--lr", "1e-4", "--train-iters", "1", "--exit-on-missing-checkpoint"]


def build(args: argparse.Namespace):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(config, spec, args.padded_vocab_size, args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)


def one_process_tracker_reads() -> None:
    """Megatron-LM's read_metadata (the tracker file) as it is, but its cross-rank max of the iteration, a CUDA
    tensor, skipped: one process, as its own branch for an uninitialised process group does."""
    from megatron.training import checkpointing

    original = checkpointing.read_metadata

    def read_metadata(tracker_filename):
        initialized = dist.is_initialized
        dist.is_initialized = lambda: False
        try:
            return original(tracker_filename)
        finally:
            dist.is_initialized = initialized
    checkpointing.read_metadata = read_metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True)
    parser.add_argument("--vocab-size", type=int, required=True, help="the export's vocabulary rows")
    parser.add_argument("--megatron-flags", default="", help="more flags for Megatron-LM, as its user passes them "
                        "(its load_args_from_checkpoint leaves some architecture flags out: --qk-layernorm)")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    one_process_tracker_reads()
    flags = [*FLAGS, "--load", options.load, "--vocab-size", str(options.vocab_size - 1),  # NullTokenizer: + EOD
             *options.megatron_flags.split()]
    args = megatron_args(flags, options.vocab_size, from_checkpoint=True)
    start_parallel_state()
    from megatron.training.checkpointing import load_checkpoint

    model = build(args)
    iteration, _ = load_checkpoint([model], None, None)
    torch.save(causal_logits(model, options.vocab_size, 16), os.path.join(options.load, "megatron_lm_logits.pt"))
    print(f"Megatron-LM's load_checkpoint read {options.load} (--finetune: training would start at iteration "
          f"{iteration}); {args.num_layers} layers, hidden {args.hidden_size}, {args.num_query_groups} query groups")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
