"""Validation of the parallel layout flags (tensor, sequence, context, pipeline, data parallel),
before anything is built: every problem is one ValueError naming the flag and the fix, which
`parse_args` prints as one line with exit code 2."""

from __future__ import annotations

import argparse
import math

from megatron.training.data_parallel_args import FSDP2_STRATEGIES

SUPPORTED_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def validate_parallel(args: argparse.Namespace) -> None:
    from megatron.core.parallel_state import check_layout

    check_layout(args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                 args.context_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size,
                 getattr(args, "num_distributed_optimizer_instances", 1))
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel
    if args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "no_shard":
        args.data_parallel_sharding_strategy = "optim"  # at least ZeRO-1 (FSDP2 strategies shard more)
    if args.data_parallel_sharding_strategy not in SUPPORTED_SHARDING:
        raise ValueError(f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} (or "
                         "--use-distributed-optimizer) is not supported by this release yet; use no_shard")
    bf16_moments = "bf16" in (getattr(args, "exp_avg_dtype", "fp32"), getattr(args, "exp_avg_sq_dtype", "fp32"))
    if bf16_moments and args.data_parallel_sharding_strategy in FSDP2_STRATEGIES:
        raise ValueError(f"bf16 Adam moments (--exp-avg-dtype / --exp-avg-sq-dtype) are not supported with "
                         f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} (FSDP2) yet; use "
                         "optim (ZeRO-1) or fp32 moments")
    weight_copies = getattr(args, "cache_low_precision_weights", False)
    if weight_copies and args.data_parallel_sharding_strategy in FSDP2_STRATEGIES:
        raise ValueError("--cache-low-precision-weights does not apply under FSDP2 (--data-parallel-sharding-strategy "
                         f"{args.data_parallel_sharding_strategy} gathers the weights in bf16 itself); drop it")


def validate_parallel_shapes(args: argparse.Namespace) -> None:
    """What the model's shapes must divide by under this layout (after the model configs exist)."""
    _validate_tensor_parallel_shapes(args)
    _validate_context_parallel_shapes(args)


def _validate_context_parallel_shapes(args: argparse.Namespace) -> None:
    from megatron.core.transformer.context_parallel import load_balanced, shard_divisor

    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp == 1:
        return
    if args.cp_comm_type == "a2a":  # (p2p and a2a+p2p are refused by TransformerConfig.validate)
        _validate_ulysses_heads(args)
    dlm = args.dlm_config
    mask_type = "causal" if dlm.model_running_mode == "vanilla" else dlm.effective_mask_type
    need, why = shard_divisor(cp, mask_type), ("2 x " if load_balanced(mask_type) else "") + "--context-parallel-size"
    if args.sequence_parallel:
        need, why = math.lcm(need, cp * tp), why + " and --context-parallel-size x --tensor-model-parallel-size"
    if args.seq_length % need:
        raise ValueError(f"--seq-length {args.seq_length} is not divisible by {need} ({why}, which context "
                         f"parallelism with {mask_type} attention needs)")
    if dlm.is_diffusion and dlm.varilen_prob > 0 and dlm.varilen_multiple % need:
        raise ValueError(f"--difflm-varilen-multiple {dlm.varilen_multiple} is not divisible by {need} ({why}), "
                         f"which context parallelism needs to split a cut sequence; pass --difflm-varilen-multiple "
                         f"{math.lcm(dlm.varilen_multiple, need)}")


def _validate_ulysses_heads(args: argparse.Namespace) -> None:
    """--cp-comm-type a2a splits each tensor-parallel rank's heads over the cp ranks."""
    cp, tp, config = args.context_parallel_size, args.tensor_model_parallel_size, args.transformer_config
    heads, kv_heads = config.num_attention_heads // tp, max(config.num_query_groups // tp, 1)
    if heads % cp or (kv_heads % cp and cp % kv_heads):
        raise ValueError(f"--cp-comm-type a2a needs the {heads} attention heads per tensor-parallel rank divisible "
                         f"by --context-parallel-size {cp} (and the {kv_heads} kv heads divisible by it or "
                         "dividing it); use --cp-comm-type all_gather")


def _validate_tensor_parallel_shapes(args: argparse.Namespace) -> None:
    """Divisibility the tensor-parallel split needs, checked before any model is built."""
    tp = args.tensor_model_parallel_size
    config = args.transformer_config
    if tp == 1:
        return
    if config.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {config.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    groups = config.num_query_groups
    if groups % tp and (tp % groups or (tp // groups) % 2):
        raise ValueError(f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: the kv heads must "
                         "divide evenly over the ranks, or the ranks over the kv heads an even number of times")
    if config.ffn_hidden_size % tp:
        raise ValueError(f"--ffn-hidden-size {config.ffn_hidden_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    varilen = getattr(args, "difflm_varilen_prob", 0.0) > 0
    if varilen and args.sequence_parallel and args.difflm_varilen_multiple % tp:
        raise ValueError(f"--difflm-varilen-multiple {args.difflm_varilen_multiple} is not divisible by "
                         f"--tensor-model-parallel-size {tp}, which --sequence-parallel needs to split a cut "
                         f"sequence; pass --difflm-varilen-multiple {math.lcm(args.difflm_varilen_multiple, tp)}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size {tp}, "
                         "which --sequence-parallel needs")



def validate_pipeline(args: argparse.Namespace) -> None:
    """The layer split over pipeline ranks and virtual stages (layer_split.py), and what interleaving needs."""
    from megatron.core.pipeline_parallel.layer_split import stage_layer_counts, virtual_size_from_flags

    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if args.num_layers_per_virtual_pipeline_stage is not None and (first is not None or last is not None):
        raise ValueError("--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first/last-"
                         "pipeline-num-layers; give --num-virtual-stages-per-pipeline-rank instead")
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    args.virtual_pipeline_model_parallel_size = virtual_size_from_flags(
        args.num_layers + embedding + loss, pp, args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank)
    args.pipeline_layer_counts = stage_layer_counts(args.num_layers, pp, args.virtual_pipeline_model_parallel_size,
                                                    first, last, embedding, loss)
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        raise ValueError(f"--global-batch-size {args.global_batch_size} gives {args.num_microbatches} micro-batches "
                         f"per replica, which the interleaved schedule needs divisible by "
                         f"--pipeline-model-parallel-size {pp}; use a multiple of "
                         f"{args.micro_batch_size * args.data_parallel_size * pp} (micro-batch x data-parallel x "
                         "pipeline sizes)")


