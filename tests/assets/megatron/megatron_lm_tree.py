"""What the asset scripts that run Megatron-LM's own code (its repository's tree, not the megatron-core wheel:
make_legacy_gpt.py, make_megatron_lm_save.py, megatron_lm_loads_export.py) share: running it on CPU (gloo), its
args as its initialize_megatron leaves them, its parallel state for one tensor-parallel group, and the logits of
fixed token ids.

On CPU, the calls of Megatron-LM that need CUDA are replaced: the current device, stream synchronisation, the CUDA
RNG state a save collects, the model-parallel RNG tracker's CUDA streams (dropout is 0), and the CUDA device check
of its argument validation.
"""

import sys

import torch


def run_on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # collected even with --no-save-rng


def megatron_args(flags, vocab: int, from_checkpoint: bool = False):
    """Megatron-LM's parse_args of `flags` (load_args_from_checkpoint first with `from_checkpoint`, as
    --use-checkpoint-args does), the vocabulary and model type pretrain() sets, validate_args; set as its
    global args."""
    from megatron.core.enums import ModelType
    from megatron.training import arguments, global_vars

    arguments.get_device_arch_version = lambda: 9
    sys.argv = [sys.argv[0], *flags]
    args = arguments.parse_args()
    if from_checkpoint:
        from megatron.training.checkpointing import load_args_from_checkpoint

        args, _ = load_args_from_checkpoint(args)
    args.padded_vocab_size, args.model_type = vocab, ModelType.encoder_or_decoder
    arguments.validate_args(args)
    global_vars.set_args(args)
    global_vars._set_timers(args)
    return args


def start_parallel_state(tp: int = 1) -> None:
    """Its parallel state (`tp` tensor-parallel ranks, one stage), micro-batch calculator and RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    parallel_state.initialize_model_parallel(tp, 1)
    init_num_microbatches_calculator(0, None, 1, 1, 1)
    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    tracker.fork = lambda *names, **kwargs: torch.random.fork_rng(devices=[])


def perturbed(model):
    """Every tensor moved off its initialisation (norms start at one, biases at zero), by a draw seeded by its
    size; in eval mode."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel()))
                           * 0.02)
    return model.eval()


def causal_logits(model, vocab: int, length: int) -> dict:
    """{"tokens", "logits"} of two fixed rows of `length` token ids, causal (Megatron's mask: True = masked out)."""
    tokens = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(length).expand(2, length)
    causal = torch.ones(1, 1, length, length, dtype=torch.bool).triu(1)
    with torch.no_grad():
        return {"tokens": tokens, "logits": model.eval()(tokens, positions, causal).float()}
