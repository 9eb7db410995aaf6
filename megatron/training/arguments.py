"""Megatron-compatible command-line flags, their validation, and the configs they build.

Flags keep Megatron-LM's names and meaning. Every problem found here is reported as one
line by argparse (exit code 2) before any process group, model or dataset is built; that
includes a flag that would change nothing (only the DLM flags in vanilla mode merely warn).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Collection, List, Optional

import torch

from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.compat_args import (MEGATRON_ATTENTION_BACKENDS, add_compat_args, print_notes,
                                           removed_flag_error, resolve_compat_args, unknown_flag_error)
from megatron.training.logging_args import LOGGING_FLAG_NEEDS, add_logging_args, validate_logging_args
from megatron.training.moe_args import add_moe_args, moe_config_from_args, validate_moe_args
from megatron.training.precision_args import (PRECISION_FLAG_NEEDS, PRECISION_FLAG_NOTES, add_precision_args,
                                              validate_precision_args)
from megatron.training.rerun_args import RERUN_FLAG_NEEDS, add_rerun_args, validate_rerun_args
from megatron.training.sft_args import SFT_FLAG_NEEDS, add_sft_args, validate_sft_args
from megatron.training.lm_eval_args import LM_EVAL_FLAG_NEEDS, add_lm_eval_args, validate_lm_eval_args
from megatron.training.data_parallel_args import (DATA_PARALLEL_FLAG_NEEDS, add_data_parallel_args,
                                                  validate_data_parallel_args)
from megatron.training.parallel_args import validate_parallel, validate_parallel_shapes, validate_pipeline
from megatron.training import schedule_args
from megatron.training.rope_args import (ROPE_FIELD_FLAGS, ROPE_FLAG_NEEDS, add_rope_args, rope_config_fields,
                                         validate_rope_args)
from megatron.training.checkpoint_flags import (CHECKPOINT_FLAG_NEEDS, CKPT_FORMATS, add_checkpoint_flags,
                                               check_writable_dir, validate_checkpoint_flags)
from megatron.training.configs import CheckpointConfig, LoggingConfig, RunRecord, TrainingConfig
from megatron.training.data_args import validate_data_args
from megatron.training.tokenizer import add_tokenizer_args

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# Parallel layouts the current release trains; the flags exist so launch scripts stay stable.

# Sizes and counts that must be >= 1 when given (None means "not given": derived later).
POSITIVE_INT_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                      "global_batch_size", "vocab_size", "ffn_hidden_size", "kv_channels", "num_query_groups",
                      "max_position_embeddings", "train_samples", "exit_interval", "keep_last_checkpoints",
                      "max_consecutive_nan_iterations", "distributed_timeout_minutes", "loss_scale_window",
                      "hysteresis", "difflm_block_size", "difflm_loss_chunk_size", "difflm_eval_mc_samples",
                      "num_layers_per_virtual_pipeline_stage",
                      "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                      "decoder_last_pipeline_num_layers")
NON_NEGATIVE_INT_FLAGS = ("eval_iters", "num_workers", "lr_warmup_iters")
_INF = float("inf")
# Float flags of the optimizer and the loop: (the allowed range as text, its test). Every test is
# a chained comparison, which NaN and +-inf fail. The model's floats are TransformerConfig's.
FLOAT_FLAG_RANGES = {
    "lr": (">= 0", lambda v: 0.0 <= v < _INF),
    "min_lr": (">= 0", lambda v: 0.0 <= v < _INF),
    "lr_warmup_init": (">= 0", lambda v: 0.0 <= v < _INF),
    "lr_warmup_fraction": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    "weight_decay": (">= 0", lambda v: 0.0 <= v < _INF),
    "clip_grad": (">= 0 (0 disables clipping)", lambda v: 0.0 <= v < _INF),
    "adam_beta1": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "adam_beta2": ("in [0, 1)", lambda v: 0.0 <= v < 1.0),
    "adam_eps": ("> 0", lambda v: 0.0 < v < _INF),
    "initial_loss_scale": ("> 0", lambda v: 0.0 < v < _INF),
    "loss_scale": ("> 0", lambda v: 0.0 < v < _INF),
    "min_loss_scale": ("> 0", lambda v: 0.0 < v < _INF),
    "exit_duration_in_mins": ("> 0", lambda v: 0.0 < v < _INF),
}

# Flags that act only together with another setting: (flag's dest, what it needs as typed, the test).
# These are flag rules, not config rules: core configs legitimately carry unused fields (tests and
# converters build one config for several mask types).
FLAG_NEEDS = (
    ("sliding_window", "--attention-mask-type sliding_window or sliding_window_two_sided",
     lambda a: getattr(a, "attention_mask_type", None) in ("sliding_window", "sliding_window_causal",
                                                           "sliding_window_two_sided")),
    ("difflm_block_size", "--attention-mask-type block_causal or --difflm-block-diffusion",
     lambda a: a.attention_mask_type == "block_causal" or a.difflm_block_diffusion),
    ("difflm_block_size_schedule", "--attention-mask-type block_causal or --difflm-block-diffusion",
     lambda a: a.attention_mask_type == "block_causal" or a.difflm_block_diffusion),
    ("difflm_per_document_t", "--reset-attention-mask (packed documents)", lambda a: a.reset_attention_mask),
    ("difflm_loss_chunk_size", "--difflm-masked-only-loss", lambda a: a.difflm_masked_only_loss),
    ("difflm_loss_kernel", "--difflm-compile-loss", lambda a: a.difflm_compile_loss),
    ("difflm_varilen_multiple", "--difflm-varilen-prob > 0", lambda a: a.difflm_varilen_prob > 0),
    ("difflm_t_logit_normal_mean", "--difflm-t-distribution logit_normal",
     lambda a: a.difflm_t_distribution == "logit_normal"),
    ("difflm_t_logit_normal_std", "--difflm-t-distribution logit_normal",
     lambda a: a.difflm_t_distribution == "logit_normal"),
    ("difflm_t_beta", "--difflm-t-distribution beta", lambda a: a.difflm_t_distribution == "beta"),
    ("difflm_t_uniform_mix", "--difflm-t-distribution logit_normal or beta",
     lambda a: a.difflm_t_distribution != "uniform"),
    ("difflm_t_importance_weight", "--difflm-t-distribution logit_normal or beta",
     lambda a: a.difflm_t_distribution != "uniform"),
    ("num_query_groups", "--group-query-attention", lambda a: a.group_query_attention),
    ("recompute_method", "--recompute-granularity full", lambda a: a.recompute_granularity == "full"),
    ("recompute_num_layers", "--recompute-granularity full", lambda a: a.recompute_granularity == "full"),
    ("fp8_recipe", "--fp8-format", lambda a: a.fp8_format is not None),
    ("exp_avg_dtype", "--use-precision-aware-optimizer", lambda a: a.use_precision_aware_optimizer),
    ("exp_avg_sq_dtype", "--use-precision-aware-optimizer", lambda a: a.use_precision_aware_optimizer),
    ("cache_low_precision_weights", "--bf16 or --fp16", lambda a: a.bf16 or a.fp16),
    ("cache_low_precision_weights", "gradient-accumulation fusion (drop --no-gradient-accumulation-fusion)",
     lambda a: a.gradient_accumulation_fusion),
    ("lr_wsd_decay_style", "--lr-decay-style WSD", lambda a: a.lr_decay_style == "WSD"),
    ("lr_wsd_decay_iters", "--lr-decay-style WSD", lambda a: a.lr_decay_style == "WSD"),
    ("wandb_exp_name", "--wandb-project", lambda a: a.wandb_project is not None),
    ("cp_comm_type", "--context-parallel-size > 1", lambda a: a.context_parallel_size > 1),
    ("account_for_embedding_in_pipeline_split", "--pipeline-model-parallel-size > 1",
     lambda a: a.pipeline_model_parallel_size > 1),
    ("account_for_loss_in_pipeline_split", "--pipeline-model-parallel-size > 1",
     lambda a: a.pipeline_model_parallel_size > 1),
) + PRECISION_FLAG_NEEDS + ROPE_FLAG_NEEDS + CHECKPOINT_FLAG_NEEDS + DATA_PARALLEL_FLAG_NEEDS + LOGGING_FLAG_NEEDS
FLAG_NEEDS += schedule_args.SCHEDULE_FLAG_NEEDS
FLAG_NEEDS += RERUN_FLAG_NEEDS + SFT_FLAG_NEEDS
FLAG_NEEDS += LM_EVAL_FLAG_NEEDS
# Like FLAG_NEEDS, but only a note: Megatron-LM's own scripts pass these with --mock-data.
FLAG_NOTES = (
    ("split", "--data-path (it splits those documents)", lambda a: bool(a.data_path)),
    ("data_cache_path", "--data-path or --train-data-path (--mock-data has no index files)",
     lambda a: not a.mock_data),
    *((dest, "--fp16 (bf16 needs no loss scaling)", lambda a: a.fp16)
      for dest in ("loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "initial_loss_scale")),
) + PRECISION_FLAG_NOTES
# What only the diffusion objective reads: with --model-running-mode vanilla (causal attention,
# next-token loss, no corruption) these do nothing. (--mask-token and --add-mask-token are not
# here: they shape the vocabulary and the tokenizer identity a checkpoint records.)
DLM_ONLY_FLAGS = ("attention_mask_type", "sliding_window", "difflm_block_size", "difflm_block_size_schedule",
                  "difflm_eps", "difflm_t_sampling", "difflm_t_min", "difflm_t_max", "difflm_t_distribution",
                  "difflm_block_diffusion", "difflm_ignore_bos", "difflm_ar_loss_weight",
                  "difflm_confidence_loss_weight", "difflm_loss_weight", "difflm_loss_normalizer",
                  "difflm_varilen_prob", "difflm_varilen_multiple", "difflm_per_document_t", "difflm_eval_mc_samples")
# The file and size flags each --tokenizer-type reads; given to another type they would be ignored.
TOKENIZER_INPUT_FLAGS = {"NullTokenizer": ("vocab_size",), "SentencePieceTokenizer": ("tokenizer_model",),
                         "HuggingFaceTokenizer": ("tokenizer_model",), "GPT2BPETokenizer": ("vocab_file", "merge_file")}
# Config fields whose flag is not `--field-name` (TransformerConfig) or `--difflm-field-name` (DLMConfig).
CONFIG_FIELD_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "vocab_size": "--vocab-size",
                      "unpadded_vocab_size": "--vocab-size", "gated_linear_unit": "--swiglu", "activation": "--swiglu",
                      "add_bias_linear": "--disable-bias-linear", "model_running_mode": "--model-running-mode",
                      "attention_mask_type": "--attention-mask-type", "mask_token_id": "--mask-token",
                      "seed": "--seed", **ROPE_FIELD_FLAGS}


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model shape")
    g.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, help="Width of the residual stream.")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP inner width (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, help="Number of query heads.")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1, help="Key/value heads with --group-query-attention.")
    g.add_argument("--kv-channels", type=int, help="Head dimension (default hidden size / heads).")
    g.add_argument("--seq-length", type=int, help="Training sequence length.")
    g.add_argument("--max-position-embeddings", type=int, help="Longest position (default --seq-length).")
    g.add_argument("--position-embedding-type", default="rope", choices=["rope", "yarn", "learned_absolute"],
                   help="RoPE, RoPE with YaRN context extension, or a learned table (pretrain_gpt.py's default).")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE theta.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of head dims that rotate.")
    add_rope_args(g)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of every norm.")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="Zero-centred norm scales: each norm stores w and multiplies by 1 + w (Megatron's "
                        "LayerNorm-1p, for RMSNorm too).")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalise queries and keys per head.")
    g.add_argument("--qk-layernorm-scope", default="head", choices=["head", "all"],
                   help="With --qk-layernorm: normalise each head (Qwen3) or the whole query / key "
                        "projection before the split into heads (all: OLMoE, OLMo2).")
    g.add_argument("--swiglu", action="store_true", help="Gated SiLU MLP (default: GeLU, not gated).")
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers.")
    g.add_argument("--add-qkv-bias", action="store_true", help="Bias on the QKV projection only.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate output layer instead of the transposed embedding.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Attention-probability dropout (Megatron's default, 0.1; DLM recipes pass 0.0).")  # noqa: E501
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Residual-branch and embedding dropout (Megatron's default, 0.1; DLM recipes pass 0.0).")  # noqa: E501
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the weight init.")
    g.add_argument("--sliding-window", type=int, help="Window of the sliding_window attention mask.")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "sdpa", "sdpa_flash", "flex", "math"] + list(MEGATRON_ATTENTION_BACKENDS),
                   help="Core attention kernel; auto picks the fastest correct one. Megatron's names map onto "
                        "ours: flash = sdpa_flash (SDPA, flash kernel first), fused = sdpa (cuDNN first), "
                        "unfused and local = math (explicit fp32 softmax).")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], help="Activation recompute.")
    g.add_argument("--recompute-method", choices=["uniform", "block"], help="Which layers full recompute covers.")
    g.add_argument("--recompute-num-layers", type=int, help="Layers per group (uniform) or recomputed (block).")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile every transformer layer in place (one graph shared by all layers; "
                        "embedding and loss stay eager). The first steps pay the compile time.")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1, help="Samples per micro-batch per GPU.")
    g.add_argument("--global-batch-size", type=int, help="Samples per step (default micro x data-parallel).")
    g.add_argument("--train-iters", type=int, help="Total optimizer steps.")
    g.add_argument("--train-samples", type=int, help="Total samples (alternative to --train-iters).")
    g.add_argument("--seed", type=int, default=1234, help="Seed of init, dropout, data and corruption.")
    g.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights and grads.")
    g.add_argument("--fp16", action="store_true", help="fp16 compute with dynamic loss scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16, help="fp16 starting loss scale.")
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default: dynamic).")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the dynamic scale's floor.")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: clean steps in a row before the dynamic scale doubles.")
    g.add_argument("--hysteresis", type=int, default=2, help="fp16: overflowing steps before the dynamic scale halves.")
    g.add_argument("--max-consecutive-nan-iterations", type=int, default=10,
                   help="Stop after this many non-finite loss or grad-norm steps in a row.")
    g.add_argument("--exit-interval", type=int, help="Exit after the iteration divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=float, help="Exit after this many minutes of training.")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic kernels only (torch.use_deterministic_algorithms): repeatable runs, slower.")

    g = parser.add_argument_group("learning rate and optimizer")
    g.add_argument("--optimizer", default="adam", choices=["adam"], help="AdamW (decoupled weight decay).")
    g.add_argument("--lr", type=float, default=1e-4, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor of the decay.")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    g.add_argument("--lr-warmup-fraction", type=float, help="Warmup as a fraction of --lr-decay-iters.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at step 0 of warmup.")
    g.add_argument("--lr-decay-iters", type=int, help="Steps over which to decay (default --train-iters).")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, help="Length of the WSD decay phase.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay (not on norms/biases).")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0 disables).")
    g.add_argument("--compile-optimizer-step", action="store_true",
                   help="AdamW's step compiled by torch.compile, one kernel per parameter (CompiledAdamW), "
                        "instead of torch's fused step; the same update and checkpoint state.")


def _add_data_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true", help="Deterministic synthetic documents, no files.")
    g.add_argument("--data-path", nargs="*", help="Prefixes of .bin/.idx files, optionally weighted: 0.7 a 0.3 b.")
    g.add_argument("--split", default="969,30,1", help="Train,valid,test proportions of --data-path documents.")
    g.add_argument("--train-data-path", nargs="*", help="Training prefixes (instead of --data-path/--split).")
    g.add_argument("--valid-data-path", nargs="*", help="Validation prefixes.")
    g.add_argument("--test-data-path", nargs="*", help="Test prefixes.")
    g.add_argument("--data-args-path", help="A text file holding the --data-path words (weights and prefixes).")
    g.add_argument("--per-split-data-args-path",
                   help='A JSON file {"train": ..., "valid": ..., "test": ...} holding the per-split data paths '
                        "(lists, or strings of words).")
    g.add_argument("--data-cache-path", help="Where dataset index files are cached (default: beside the data).")
    add_tokenizer_args(g, optional_type=True)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart positions after each EOD.")
    g.add_argument("--reset-attention-mask", action="store_true", help="Attend within documents only.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss (and no corruption) on EOD tokens.")
    g.add_argument("--num-workers", type=int, default=0, help="Data loader worker processes.")
    g.add_argument("--no-mmap-bin-files", action="store_true",
                   help="Read .bin token files through a file handle instead of memory-mapping them.")

    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Print and record every N steps.")
    g.add_argument("--log-throughput", action="store_true", help="Add tokens/s, TFLOP/s and MFU to the line.")
    g.add_argument("--tensorboard-dir", help="Write tensorboard scalars here.")
    g.add_argument("--wandb-project", help="Also log to this Weights & Biases project (needs wandb).")
    g.add_argument("--wandb-exp-name", help="Weights & Biases run name.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Evaluate every N steps.")
    g.add_argument("--eval-iters", type=int, default=100, help="Global batches per evaluation (0 disables).")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", help="Directory for checkpoints (iter_NNNNNNN/ and the tracker file).")
    g.add_argument("--save-interval", type=int, help="Save every N iterations (and at the end of training).")
    g.add_argument("--load", help="Resume from the latest checkpoint in this directory, if there is one.")
    g.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
                   help="torch_dist: sharded torch.distributed.checkpoint, loadable under any layout; the only "
                        "format written here (Megatron's other values stop with one line).")
    g.add_argument("--async-save", action="store_true",
                   help="Write checkpoints in the background: training continues once the shards are copied "
                        "to host memory (pinned buffers, kept between saves: one host copy of this rank's "
                        "shards); the tracker moves when every rank finished writing.")
    g.add_argument("--no-save-optim", action="store_true", help="Save weights only.")
    g.add_argument("--no-load-optim", action="store_true", help="Load weights only (fresh optimizer).")
    g.add_argument("--no-load-rng", action="store_true", help="Keep this run's RNG states.")
    g.add_argument("--finetune", action="store_true",
                   help="Load weights only and start at iteration 0; also accepts a checkpoint whose network "
                        "computes another function (rotary base, norm epsilon, mask token, running mode, ...).")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the architecture flags (shape, norms, biases, RoPE, running mode) and, when not "
                        "given, --seq-length from the latest checkpoint under --load.")
    g.add_argument("--keep-last-checkpoints", type=int, help="Delete all but the newest N checkpoints.")
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   help="On resume, keep this run's LR and weight-decay schedule flags (the checkpoint's schedule "
                        "wins otherwise, with a warning per changed value); only the position is restored.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM (or --exit-signal): finish the step, save a checkpoint (with --save), exit with "
                        "code 0.")
    g.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP",
                                                               "SIGQUIT"],
                   help="The signal --exit-signal-handler waits for.")
    add_checkpoint_flags(g)


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, help="Layers per interleaved model chunk.")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, help="Interleaved model chunks per rank.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, help="Layers of the first pipeline rank.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, help="Layers of the last pipeline rank.")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one layer of the first pipeline stage.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the loss as one layer of the last pipeline stage.")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", default="all_gather", choices=("all_gather", "p2p", "a2a", "a2a+p2p"),
                   help="Context parallelism's attention: all_gather (K/V to every rank) or a2a (Ulysses).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Ranks the experts of a layer are split over.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1, help="Ranks each expert is split over.")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Same as --data-parallel-sharding-strategy optim.")
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="FSDP2 strategies: each layer prefetches the next layer's weights explicitly (default: "
                        "when the next layer starts). ZeRO-1 (optim) broadcasts them after the step (no effect).")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="Default: nccl on GPU, gloo on CPU.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--check-args", action="store_true",
                   help="Validate the flags for a world of WORLD_SIZE processes and exit (0, or 2 with one line). "
                        "The launch scripts run this once before torchrun, so that a bad flag is one line rather "
                        "than one per worker and torchrun's failure report.")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors (every rank parses the same flags before the process group
    exists) are printed by rank 0 only: one line on the console, not one per worker."""

    def error(self, message: str):
        if _is_rank_zero():
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def exit(self, status: int = 0, message: Optional[str] = None):
        super().exit(status, message if _is_rank_zero() else None)


def build_parser(extra_args_provider: Optional[ExtraArgsProvider] = None) -> argparse.ArgumentParser:
    parser = _Parser(description="MegaDLMs pretraining", allow_abbrev=False,
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_args(parser)
    add_moe_args(parser)
    _add_training_args(parser)
    add_precision_args(parser)
    schedule_args.add_schedule_args(parser)
    _add_data_and_logging_args(parser)
    add_logging_args(parser)
    add_rerun_args(parser)
    add_sft_args(parser)
    add_lm_eval_args(parser)
    _add_checkpoint_args(parser)
    _add_distributed_args(parser)
    add_data_parallel_args(parser)
    add_compat_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None, extra_args_provider: Optional[ExtraArgsProvider] = None,
               world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; any problem exits with one line and code 2 (argparse's convention).
    Flags accepted for compatibility that change nothing print one note each (compat_args.py)."""
    parser = build_parser(extra_args_provider)
    removed = removed_flag_error(sys.argv[1:] if argv is None else argv)
    if removed:  # a lever of ours that is gone: one line, what to pass instead
        parser.exit(2, f"{parser.prog}: error: {removed}\n")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line: the closest flag we accept, or why a Megatron feature is refused
        parser.exit(2, f"{parser.prog}: error: {unknown_flag_error(unknown, parser._option_string_actions)}\n")
    # A flag counts as given when its value differs from the default: a default typed out
    # explicitly changes nothing, so the rules about ignored flags need no sentinel defaults.
    given = {dest for dest, value in vars(args).items() if value != parser.get_default(dest)}
    args.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        notes = resolve_compat_args(args, given)
        if args.use_checkpoint_args:
            from megatron.training.checkpoint_args import apply_checkpoint_args

            apply_checkpoint_args(args)
        notes += validate_args(args, given)
    # ImportError: a flag's optional dependency is missing; OSError: a path given cannot be read or written.
    except (ValueError, ImportError, OSError) as error:
        # One line (from rank 0), argparse's exit code; no usage block: the flags were all recognised.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if not args.check_args:  # the launch scripts' check before torchrun: the run prints the notes
        print_notes(notes)
    return args


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required")


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def _validate_ranges(args: argparse.Namespace) -> None:
    """Numbers out of range fail here, by flag, before anything is derived from them."""
    for dests, lowest in ((POSITIVE_INT_FLAGS, 1), (NON_NEGATIVE_INT_FLAGS, 0)):
        for dest in dests:
            value = getattr(args, dest, None)
            if value is not None and value < lowest:
                raise ValueError(f"{_flag(dest)} {value} must be >= {lowest}")
    for dest, (allowed, holds) in FLOAT_FLAG_RANGES.items():
        value = getattr(args, dest, None)
        if value is not None and not holds(value):
            raise ValueError(f"{_flag(dest)} {value} must be a finite number {allowed}")


def _is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # the flags are parsed before the process group exists


def _warn(message: str) -> None:
    if _is_rank_zero():  # every rank parses the flags; one copy of the warning is enough
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _validate_flag_dependencies(args: argparse.Namespace, given: Collection[str]) -> None:
    """A flag that would change nothing fails (or, for the DLM flags in vanilla mode, warns)."""
    given = set(given)
    if getattr(args, "model_running_mode", "vanilla") == "vanilla":
        # A causal sliding window is an autoregressive pattern: vanilla reads it.
        window = (("attention_mask_type", "sliding_window") if getattr(args, "attention_mask_type", None)
                  in ("sliding_window", "sliding_window_causal") else ())
        ignored = [dest for dest in DLM_ONLY_FLAGS if dest in given and dest not in window]
        if ignored:
            # Only a warning: one launch script serving both modes (examples/quickstart.sh with
            # MODE=vanilla) passes its DLM flags in vanilla mode too, and should keep working.
            shown = ", ".join(_flag(d) if getattr(args, d) is True else f"{_flag(d)} {getattr(args, d)}"
                              for d in ignored)
            _warn(f"{shown}: no effect with --model-running-mode vanilla (causal attention, next-token loss, "
                  "no corruption); ignored. Drop them, or choose a difflm running mode")
        given -= set(DLM_ONLY_FLAGS)
    for dest, needed, holds in FLAG_NEEDS:
        if dest in given and not holds(args):
            raise ValueError(f"{_flag(dest)} has no effect without {needed}; add that or drop {_flag(dest)}")
    readers = TOKENIZER_INPUT_FLAGS.get(args.tokenizer_type, ())
    # --vocab-size is also checked against a file tokenizer's size (data_args.py), as Megatron's scripts pass both.
    for dest in ("tokenizer_model", "vocab_file", "merge_file"):
        if dest in given and dest not in readers:
            types = [name for name, reads in TOKENIZER_INPUT_FLAGS.items() if dest in reads]
            raise ValueError(f"{_flag(dest)} is not read by --tokenizer-type {args.tokenizer_type} (only by "
                             f"{' and '.join(types)}); pass the --tokenizer-type it belongs to or drop it")


def _flag_notes(args: argparse.Namespace, given: Collection[str]) -> List[str]:
    """Notes for flags that change nothing in this run but that Megatron's scripts pass anyway."""
    notes = [f"{_flag(dest)} has no effect without {needed}; ignored" for dest, needed, holds in FLAG_NOTES
             if dest in given and not holds(args)]
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron-LM does
        notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; turned off")
    return notes


def _config_error_hint(error: ValueError) -> str:
    """Names the flag behind a config error: config messages start with `Owner.field` (their docstring)."""
    match = re.match(r"(TransformerConfig|DLMConfig|MoEConfig)\.(\w+)", str(error))
    if match is None:
        return "check the corresponding command-line flag"
    owner, field = match.groups()
    if owner == "MoEConfig":
        return "flag --num-experts" if field == "num_experts" else f"flag --moe-{field.replace('_', '-')}"
    default = f"--{'difflm-' if owner == 'DLMConfig' else ''}{field.replace('_', '-')}"
    return f"flag {CONFIG_FIELD_FLAGS.get(field, default)}"


def validate_args(args: argparse.Namespace, given: Collection[str] = frozenset()) -> List[str]:
    """Fill derived values and raise ValueError naming the flag and the fix; returns the notes to print.

    `given`: the dests of the flags the user set to a non-default value; the rules about flags
    that would be ignored look only at those (empty: assume none was).
    """
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    _validate_ranges(args)
    _validate_flag_dependencies(args, given)
    validate_logging_args(args, given)
    validate_rerun_args(args, given)
    notes = _flag_notes(args, given) + validate_sft_args(args, given)
    validate_checkpoint_flags(args, given)
    validate_rope_args(args)
    notes += validate_precision_args(args, given)  # before the layouts: --fp8-format turns the weight copies on
    validate_parallel(args)
    validate_data_parallel_args(args)
    validate_lm_eval_args(args, given)  # before the TrainingConfig: it settles the draws
    _validate_batch_and_schedule(args)
    # Every rank writes checkpoint shards; only rank 0 writes tensorboard events.
    for dest in ("save", "data_cache_path") + (("tensorboard_dir",) if _is_rank_zero() else ()):
        check_writable_dir(_flag(dest), getattr(args, dest))
    validate_data_args(args)
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are both set; choose one")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                         f"{args.num_attention_heads}, so the head dimension is not whole; change one of them "
                         "or pass --kv-channels")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    # The config classes phrase problems by field; the flags are what the user typed.
    try:
        args.moe_config = moe_config_from_args(args)
        args.transformer_config = transformer_config_from_args(args)
        args.dlm_config = dlm_config_from_args(args)
        args.transformer_config.validate()
        args.dlm_config.validate(args.padded_vocab_size, args.seq_length, args.sliding_window)
        validate_moe_args(args)
    except ValueError as error:
        raise ValueError(f"{error} ({_config_error_hint(error)})") from None
    validate_parallel_shapes(args)
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                         f"{args.max_position_embeddings}")
    args.run_record = RunRecord.from_args(args)
    return notes


def _validate_batch_and_schedule(args: argparse.Namespace) -> None:
    # Batch sizes (with a ramp: every size), run length and LR lengths: schedule_args.py.
    schedule_args.resolve_batch_sizes(args)
    validate_pipeline(args)
    schedule_args.check_microbatches_per_size(args)
    schedule_args.resolve_run_length(args)
    OptimizerParamScheduler(None, **schedule_kwargs(args))  # raises naming the flag
    # The loop's typed configs, built once; their validate() checks their own flags.
    args.training_config = TrainingConfig.from_args(args)
    args.checkpoint_config = CheckpointConfig.from_args(args)
    args.logging_config = LoggingConfig.from_args(args)


def schedule_kwargs(args: argparse.Namespace) -> dict:
    return schedule_args.schedule_kwargs(args)


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size, unpadded_vocab_size=args.tokenizer.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, qk_layernorm=args.qk_layernorm,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm_scope=args.qk_layernorm_scope,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu, activation="silu" if args.swiglu else "gelu",
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent, **rope_config_fields(args),
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        params_dtype=torch.float32, bf16=args.bf16, fp16=args.fp16,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion, bias_swiglu_fusion=args.bias_swiglu_fusion,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, attention_backend=args.attention_backend,
        sliding_window=args.sliding_window, cp_comm_type=args.cp_comm_type, moe=args.moe_config,
        sequence_parallel=args.sequence_parallel)


def dlm_config_from_args(args: argparse.Namespace) -> DLMConfig:
    """DLM fields come from custom_args/difflm.py; without them the model is autoregressive."""
    if not hasattr(args, "model_running_mode"):
        return DLMConfig(model_running_mode="vanilla", seed=args.seed)
    schedule = args.difflm_block_size_schedule  # its first size is the block size unless one is given
    return DLMConfig(
        model_running_mode=args.model_running_mode, attention_mask_type=args.attention_mask_type,
        mask_token_id=args.mask_token, eps=args.difflm_eps, block_size_schedule=schedule,
        block_size=args.difflm_block_size if args.difflm_block_size or not schedule else schedule[0][1],
        block_diffusion=args.difflm_block_diffusion, ignore_bos=args.difflm_ignore_bos,
        ar_loss_weight=args.difflm_ar_loss_weight, confidence_loss_weight=args.difflm_confidence_loss_weight,
        t_sampling=args.difflm_t_sampling, t_min=args.difflm_t_min, t_max=args.difflm_t_max,
        t_distribution=args.difflm_t_distribution, t_logit_normal_mean=args.difflm_t_logit_normal_mean,
        t_logit_normal_std=args.difflm_t_logit_normal_std, t_beta_a=args.difflm_t_beta[0],
        t_beta_b=args.difflm_t_beta[1], t_uniform_mix=args.difflm_t_uniform_mix,
        t_importance_weight=args.difflm_t_importance_weight,
        loss_weight=args.difflm_loss_weight,
        loss_normalizer=args.difflm_loss_normalizer, varilen_prob=args.difflm_varilen_prob,
        varilen_multiple=args.difflm_varilen_multiple,
        per_document_t=args.difflm_per_document_t, masked_only_loss=args.difflm_masked_only_loss,
        loss_chunk_size=args.difflm_loss_chunk_size, compile_loss=args.difflm_compile_loss,
        loss_kernel=args.difflm_loss_kernel, seed=args.seed)
