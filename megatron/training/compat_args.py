"""Megatron-LM's and MegaDLMs' flags that launch scripts pass and that have no home elsewhere.

Three kinds live here (docs/megatron_compatibility.md lists every flag we accept):

- **Aliases**: another spelling of one of our settings (`--attention-backend flash`,
  `--use-torch-fsdp2`, `--recompute-activations`, `--tokenizer-type Llama2Tokenizer`). They are
  rewritten onto our flag before validation; an alias that contradicts the flag it stands for
  is one error.
- **No effect here**: a Megatron or Transformer Engine internal with no counterpart (a fusion
  toggle, `--use-mcore-models`), or a behaviour that is always on here. They are accepted, and
  each one given prints one line at start saying why it changes nothing; never ignored silently.
- **Refused**: a Megatron feature we do not have. The error names the flag and the reason;
  every other unknown flag gets the closest flag we accept.
- **Removed**: a flag of ours (or one value of a flag) that is gone, a lever that measured as a loss.
  The error says so and what to pass instead.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from megatron.training.tokenizer import TOKENIZER_ALIASES

_FUSION = ("a Megatron/Transformer Engine fused-kernel toggle; these ops are plain PyTorch here (fused by "
           "--torch-compile), with the unfused numerics either way")
_FP8_DELAYED = ("--fp8-recipe delayed updates its scales after every iteration here (Megatron deprecated the "
                "interval too)")


@dataclass(frozen=True)
class NoEffect:
    flag: str
    reason: str
    kwargs: dict = field(default_factory=lambda: {"action": "store_true"})
    spellings: Tuple[str, ...] = ()
    """Other spellings Megatron accepts for the same flag."""

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest", self.flag[2:].replace("-", "_"))


NO_EFFECT: Tuple[NoEffect, ...] = (
    NoEffect("--base-model", "MegaDLMs' model family: vanilla, the GPT model, is the only one here",
             {"choices": ["vanilla"], "default": None}),
    NoEffect("--use-mcore-models", "there is one model implementation here, built like Megatron core's GPTModel; "
             "Megatron's legacy model does not exist"),
    NoEffect("--transformer-impl", "layers are torch-native (no Transformer Engine); --attention-backend and "
             "--fp8-format choose the kernels",
             {"choices": ["transformer_engine", "local", "inference_optimized"], "default": "transformer_engine"}),
    NoEffect("--no-bias-gelu-fusion", _FUSION),
    NoEffect("--no-bias-dropout-fusion", _FUSION),
    NoEffect("--no-masked-softmax-fusion", _FUSION),
    NoEffect("--no-rope-fusion", _FUSION),
    NoEffect("--no-persist-layer-norm", _FUSION),
    NoEffect("--attention-softmax-in-fp32", "always so: the math backend computes the softmax in fp32, SDPA and "
             "FlexAttention accumulate it in fp32"),
    NoEffect("--apply-query-key-layer-scaling", "it guards fp16 overflow in Megatron's unfused softmax, which is "
             "always fp32 here; the scaling is mathematically neutral"),
    NoEffect("--no-create-attention-mask-in-dataloader", "the data loader never builds an attention mask here: "
             "masks are structural (mask type, document ids) and made by the model"),
    NoEffect("--no-position-embedding", "positions come from RoPE (--position-embedding-type rope); there is no "
             "learned position table to disable"),
    NoEffect("--use-rotary-position-embeddings", "RoPE is the position encoding here"),
    NoEffect("--cross-entropy-loss-fusion", "the vocab-parallel cross-entropy is always one fused pass over the "
             "logits here (max, target logit, sum of exponentials; backward softmax minus one-hot)"),
    NoEffect("--cross-entropy-fusion-impl", "the vocab-parallel cross-entropy is always one fused pass here",
             {"choices": ["native", "te"], "default": "native"}),
    NoEffect("--calculate-per-token-loss", "always so: a step's loss is the sum of token losses over the global "
             "batch divided by the global number of loss tokens (not a mean of micro-batch means)"),
    NoEffect("--tiktoken-pattern", "only Megatron's TikTokenizer reads it, and no tokenizer here does",
             {"default": None}),
    NoEffect("--fp8-interval", _FP8_DELAYED, {"type": int, "default": None}),
    NoEffect("--fp8-param-gather", "weights are kept and all-gathered in their master dtype here; each rank casts "
             "its float8 working copies once an iteration"),
    NoEffect("--cut-off-varlen-to-seqlen", "always so: documents packed into a row never attend across rows"),
    NoEffect("--tp-comm-overlap", "it needs Transformer Engine's userbuffers; tensor-parallel collectives are "
             "plain NCCL calls here"),
    NoEffect("--sft-tokenizer-prompt-format", "the chat template is applied once, when tools/preprocess_data.py "
             "--chat (--chat-template) tokenizes the data, not at run time",
             {"type": str, "default": None}),
    NoEffect("--distribute-saved-activations", "full recompute keeps each layer's input whole on every "
             "tensor-parallel rank (with --sequence-parallel it is already split)"),
    NoEffect("--use-cpu-initialization", "weights are initialised on the device, with values that do not depend "
             "on the parallel layout"),
    NoEffect("--local-rank", "the rank comes from torchrun's environment (LOCAL_RANK)", {"type": int, "default": None}),
    NoEffect("--num-dataset-builder-threads", "rank 0 builds each dataset index once; the other ranks read it",
             {"type": int, "default": None}),
    NoEffect("--trust-remote-code", "tokenizers here read tokenizer.json / SentencePiece files and never run code"),
    NoEffect("--moe-router-dtype", "the router's gate is always computed in fp32 here",
             {"choices": ["fp32"], "default": None}),
    NoEffect("--moe-permute-fusion", _FUSION),
    NoEffect("--moe-router-fusion", _FUSION),
    NoEffect("--moe-shared-expert-overlap", "the shared expert runs on the compute stream, not overlapped with "
             "the token exchange"),
    NoEffect("--moe-per-layer-logging", "always so: each MoE layer's expert load goes to tensorboard"),
    NoEffect("--main-params-dtype", "master weights are fp32 here", {"choices": ["fp32"], "default": None}),
    NoEffect("--main-grads-dtype", "gradients are accumulated in fp32 here", {"choices": ["fp32"], "default": None}),
    NoEffect("--enable-cuda-graph", "training runs without CUDA graphs here (generation has them: "
             "megatron/core/inference/cuda_graphs.py)"),
    NoEffect("--dataloader-type", "always so: the sampler is Megatron's 'single' (each sample once, resumable)",
             {"choices": ["single"], "default": None}),
    NoEffect("--use-on-the-fly-eval", "MegaDLMs' switch of the in-loop evaluation (declared there, never "
             "implemented): --lm-eval-tasks alone turns it on, and the switch needs them"),
    # Checkpointing (megatron/training/checkpoint_flags.py has the ones that act).
    NoEffect("--auto-detect-ckpt-format", "always so: --load recognises Megatron-LM's checkpoints: a torch_dist "
             "GPT loads with --finetune (README, \"Checkpoints\"); the legacy (mp_rank_XX/model_optim_rng.pt), "
             "torch_dcp and zarr formats are refused with the conversion to use"),
    NoEffect("--use-dist-ckpt", "always so: torch_dist is the format written here"),
    NoEffect("--ckpt-fully-parallel-save", "always so: each replicated tensor is written once, the writes spread "
             "over the ranks holding it (DCP's planner; --no-ckpt-fully-parallel-save writes from the lowest rank)",
             {"action": "store_true", "dest": "ckpt_fully_parallel_save_typed"}),
    NoEffect("--ckpt-fully-parallel-load", "every rank reads its own shards straight from storage (DCP); reading "
             "each replica once and broadcasting it is not implemented"),
    NoEffect("--dist-ckpt-strictness", "loading raises on keys missing from the checkpoint and ignores extra ones "
             "(Megatron's default, assume_ok_unexpected)", {"default": None}),
    NoEffect("--non-persistent-local-ckpt-algo", "an nvidia-resiliency-ext algorithm; local non-persistent saves "
             "here are one file per rank, written in parallel", {"choices": ["fully_parallel", "atomic"],
                                                                  "default": None}),
    NoEffect("--replication", "nvidia-resiliency-ext's replication of local checkpoints is not integrated"),
    NoEffect("--replication-jump", "nvidia-resiliency-ext's replication of local checkpoints is not integrated",
             {"type": int, "default": None}),
    NoEffect("--replication-factor", "nvidia-resiliency-ext's replication of local checkpoints is not integrated",
             {"type": int, "default": None}),
    NoEffect("--use-persistent-ckpt-worker", "--async-save writes from a background thread of each rank here"),
    NoEffect("--dist-ckpt-workers", "each rank writes its own shards here", {"type": int, "default": None}),
    NoEffect("--use-checkpoint-opt-param-scheduler", "always so: on resume the checkpoint's LR and weight-decay "
             "schedule wins, with a warning per changed value (--override-opt-param-scheduler keeps the flags')",
             spellings=("--use-checkpoint-opt_param-scheduler",)),
    # Data parallelism (megatron/training/data_parallel_args.py has the ones that act).
    NoEffect("--overlap-grad-reduce", "always so: the gradient reduction overlaps the backward (DDP's buckets, "
             "FSDP2's per-layer reduce-scatters); --ddp-bucket-size / --ddp-num-buckets tune DDP's"),
    NoEffect("--accumulate-allreduce-grads-in-fp32", "always so: gradients are accumulated and reduced in fp32 "
             "here (the weights are fp32), unless --grad-reduce-in-bf16, which contradicts it"),
    NoEffect("--ddp-average-in-collective", "each bucket is divided by the replicas and summed, which equals the "
             "average up to rounding"),
    NoEffect("--ddp-pad-buckets-for-high-nccl-busbw", "torch DDP lays out its own buckets"),
    NoEffect("--ddp-reduce-scatter-with-fp32-accumulation", "reductions are fp32 already (unless "
             "--grad-reduce-in-bf16)"),
    NoEffect("--overlap-param-gather-with-optimizer-step", "it needs Megatron's distributed-optimizer parameter "
             "buffers; ZeRO-1 here broadcasts the updated shards after the step"),
    NoEffect("--no-align-param-gather", "there is no per-stage parameter all-gather to align here"),
    NoEffect("--no-align-grad-reduce", "gradients are reduced after the pipeline schedule, for every stage alike",
             spellings=("--disable-align-grad-reduce",)),
    NoEffect("--ddp-param-name-patterns-for-fp32-local-accumulation", "gradients always accumulate in fp32 here",
             {"nargs": "+", "default": None}),
    NoEffect("--no-async-tensor-model-parallel-allreduce", "an old Megatron overlap toggle; tensor-parallel "
             "all-reduces are plain NCCL calls here"),
    # Logging and profiling (megatron/training/logging_args.py has the ones that act).
    NoEffect("--test-mode", "Megatron's internal real-time tests; there is nothing to test here"),
    NoEffect("--no-barrier-with-level-1-timing", "the timers here never put a barrier between phases",
             spellings=("--disable-barrier-with-level-1-timing",)),
    NoEffect("--log-throughput-to-tensorboard", "always so with --log-throughput: throughput goes to tensorboard"),
    NoEffect("--throughput-window-size", "the console averages throughput over --log-interval steps",
             {"type": int, "default": None}),
    NoEffect("--logging-level", "messages are printed by rank 0; there is no Python logging hierarchy to set",
             {"type": int, "default": None}),
    NoEffect("--use-pytorch-profiler", "--profile always uses the torch profiler here (Megatron's default is an "
             "nsys capture range)"),
    NoEffect("--nvtx-ranges", "no NVTX ranges are emitted; --profile writes a torch profiler trace"),
    NoEffect("--record-shapes", "use --pytorch-profiler-collect-shapes with --profile"),
    NoEffect("--pytorch-profiler-collect-chakra", "Chakra execution traces are not produced"),
    NoEffect("--config-logger-dir", "the run's configuration is recorded in each checkpoint's metadata.json "
             "(and in wandb's config)", {"default": None}),
    NoEffect("--te-rng-tracker", "there is no Transformer Engine RNG tracker; dropout draws come from "
             "megatron/core/tensor_parallel/random.py"),
)


@dataclass(frozen=True)
class Alias:
    """`flag` (with `value`, or any value when `values` maps it) sets our `dest` to `target`."""

    flag: str
    dest: str
    target: object = None
    values: Optional[Dict[str, object]] = None
    kwargs: dict = field(default_factory=lambda: {"action": "store_true"})


MEGATRON_ATTENTION_BACKENDS = {"flash": "sdpa_flash", "fused": "sdpa", "unfused": "math", "local": "math"}
"""Megatron's --attention-backend names -> ours: flash = TE's flash-attn (SDPA's flash kernel first),
fused = TE's cuDNN fused attention (SDPA, cuDNN first), unfused / local = explicit softmax (math)."""

ALIASES: Tuple[Alias, ...] = (
    Alias("--use-flash-attn", "attention_backend", "sdpa_flash"),
    Alias("--core-attn-implementation", "attention_backend",
          values={"TEDotProductAttention": "sdpa", "FlexAttention": "flex"},
          kwargs={"choices": ["TEDotProductAttention", "FlexAttention"], "default": None}),
    Alias("--recompute-activations", "recompute_granularity", "selective"),
    Alias("--eval-only", "skip_train", True),
    Alias("--use-torch-fsdp2", "data_parallel_sharding_strategy", "optim_grads_params"),
    Alias("--torch-fsdp2-no-reshard-after-forward", "data_parallel_sharding_strategy", "optim_grads"),
)

REFUSED_PREFIXES: Tuple[Tuple[str, str], ...] = (
    ("--multi-latent-attention", "multi-latent attention is not implemented"),
    ("--q-lora-rank", "multi-latent attention is not implemented"),
    ("--kv-lora-rank", "multi-latent attention is not implemented"),
    ("--mtp-", "multi-token prediction is not implemented"),
    ("--mamba-", "Mamba and hybrid models are not implemented"),
    ("--hybrid-", "Mamba and hybrid models are not implemented"),
    ("--is-hybrid-model", "Mamba and hybrid models are not implemented"),
    ("--spec", "layers are configured by flags here, not by a module spec"),
    ("--yaml-cfg", "configuration is by flags only"),
    ("--fp4-", "fp4 training is not implemented (fp8: --fp8-format)"),
    ("--data-parallel-random-init", "every data-parallel replica starts from the same weights here"),
    ("--optimizer-cpu-offload", "optimizer offload to the host is not implemented"),
    ("--squared-relu", "the MLP is GeLU or SwiGLU (--swiglu) here"),
    ("--openai-gelu", "the MLP is GeLU or SwiGLU (--swiglu) here"),
    ("--quick-geglu", "the MLP is GeLU or SwiGLU (--swiglu) here"),
    ("--rotary-interleaved", "RoPE rotates the two halves of each head (HF layout); interleaved pairs are not "
                             "implemented"),
    ("--fp32-residual-connection", "the residual stream follows --bf16/--fp16 here"),
    ("--moe-router-num-groups", "group-limited routing is not implemented"),
    ("--moe-router-group-topk", "group-limited routing is not implemented"),
    ("--moe-enable-deepep", "DeepEP is not used; --moe-token-dispatcher-type alltoall is the exchange"),
    ("--moe-flex-dispatcher-backend", "DeepEP/HybridEP are not used; --moe-token-dispatcher-type alltoall is the "
                                      "exchange"),
    ("--bert-", "BERT models are not part of this framework"),
    ("--vision-", "vision models are not part of this framework"),
    ("--dino-", "vision models are not part of this framework"),
    ("--ict-", "retrieval models are not part of this framework"),
    ("--rl-", "reinforcement learning is not implemented"),
    ("--grpo-", "reinforcement learning is not implemented"),
    ("--inference-", "Megatron's inference engine flags: generation here is megatron/core/inference and "
                     "examples/dlm_generation"),
    ("--fim-", "fill-in-the-middle data is not implemented"),
    ("--inprocess-", "NVIDIA resiliency-ext in-process restart is not integrated"),
    ("--ft-", "NVIDIA resiliency-ext fault tolerance is not integrated"),
    ("--enable-ft-package", "NVIDIA resiliency-ext fault tolerance is not integrated"),
    ("--one-logger", "one-logger is not integrated (tensorboard and wandb are)"),
    ("--straggler-", "the straggler detector is not integrated"),
    ("--kitchen-", "Megatron's kitchen quantization is not integrated"),
)


@dataclass(frozen=True)
class Removed:
    """`flag` (only with `value`, when one is given) was removed: refused, with why and what to pass instead."""

    flag: str
    reason: str
    value: Optional[str] = None

    @property
    def shown(self) -> str:
        return self.flag if self.value is None else f"{self.flag} {self.value}"


_MEASURED = "docs/performance.md, \"Levers measured and left off\""
REMOVED: Tuple[Removed, ...] = (
    Removed("--rmsnorm-fusion", f"its Triton kernels measured slower than torch.compile's norm kernels "
                                f"({_MEASURED}); drop the flag"),
    Removed("--fp8-output-layer", f"the output layer's float8 GEMMs measured slower than its bf16 ones ({_MEASURED}); "
                                  "drop the flag"),
    Removed("--fp8-recipe", f"per-row float8 scaling measured slower than bf16 ({_MEASURED}); use --fp8-recipe "
                            "tensorwise or delayed", value="rowwise"),
)


def removed_flag_error(argv: Sequence[str]) -> Optional[str]:
    """The one-line error for the first removed flag (or removed value, as `--flag value` or `--flag=value`)
    in `argv`, or None. Checked before parsing: a removed value is not among its flag's choices."""
    for index, word in enumerate(argv):
        flag, equals, inline = word.partition("=")
        value = inline if equals else (argv[index + 1] if index + 1 < len(argv) else None)
        for entry in REMOVED:
            if flag == entry.flag and entry.value in (None, value):
                return f"{entry.shown} was removed: {entry.reason}"
    return None


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM compatibility (megatron/training/compat_args.py)")
    for entry in NO_EFFECT:
        g.add_argument(entry.flag, *entry.spellings, help=f"Accepted, no effect: {entry.reason}.", **entry.kwargs)
    for alias in ALIASES:
        spelled = (", ".join(f"{k} = {v}" for k, v in alias.values.items()) if alias.values
                   else f"= {alias.target}")
        g.add_argument(alias.flag, help=f"Alias of --{alias.dest.replace('_', '-')} ({spelled}).", **alias.kwargs)


def _shown(args: argparse.Namespace, dest: str) -> str:
    value = getattr(args, dest)
    flag = f"--{dest.replace('_', '-')}"
    return flag if value is True else f"{flag} {value}"


def _apply_aliases(args: argparse.Namespace, given: set) -> List[str]:
    notes = []
    for alias in ALIASES:
        alias_dest = alias.flag[2:].replace("-", "_")
        if alias_dest not in given:
            continue
        target = alias.values[getattr(args, alias_dest)] if alias.values else alias.target
        if alias.dest in given and getattr(args, alias.dest) != target:
            raise ValueError(f"{_shown(args, alias_dest)} means {_shown_value(alias.dest, target)}, but "
                             f"{_shown(args, alias.dest)} is given too; drop one of them")
        setattr(args, alias.dest, target)
        given.add(alias.dest)
        notes.append(f"{_shown(args, alias_dest)} is read as {_shown_value(alias.dest, target)}")
    for dest, table in (("attention_backend", MEGATRON_ATTENTION_BACKENDS), ("tokenizer_type", TOKENIZER_ALIASES)):
        value = getattr(args, dest, None)
        if value in table:
            notes.append(f"--{dest.replace('_', '-')} {value} is read as {_shown_value(dest, table[value])} "
                         "(docs/megatron_compatibility.md)")
            setattr(args, dest, table[value])
    return notes


def _infer_tokenizer_type(args: argparse.Namespace, given: set) -> List[str]:
    """Megatron's scripts may leave --tokenizer-type out and pass only the files: name their reader
    (no files: the NullTokenizer, for --mock-data and --vocab-size)."""
    if args.tokenizer_type is not None:
        return []
    if args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
    elif args.tokenizer_model:
        args.tokenizer_type = ("SentencePieceTokenizer" if args.tokenizer_model.endswith(".model")
                               else "HuggingFaceTokenizer")
    else:
        args.tokenizer_type = "NullTokenizer"
        return []
    given.add("tokenizer_type")
    return [f"no --tokenizer-type given: the files passed are read by --tokenizer-type {args.tokenizer_type}"]


def _shown_value(dest: str, value) -> str:
    return f"--{dest.replace('_', '-')} {value}"


def resolve_compat_args(args: argparse.Namespace, given: set) -> List[str]:
    """Rewrite aliases onto our flags (adding their dests to `given`) and return the start-up
    notes: one per alias and per no-effect flag given."""
    notes = _apply_aliases(args, given) + _infer_tokenizer_type(args, given)
    if args.calculate_per_token_loss and getattr(args, "model_running_mode", "vanilla") != "vanilla" \
            and getattr(args, "difflm_loss_normalizer", "tokens") == "sequence":
        raise ValueError("--calculate-per-token-loss contradicts --difflm-loss-normalizer sequence (a mean of "
                         "per-sequence means); drop one of them")
    for entry in NO_EFFECT:
        if entry.dest in given:
            value = getattr(args, entry.dest)
            notes.append(f"{entry.flag if value is True else f'{entry.flag} {value}'} has no effect here: "
                         f"{entry.reason}")
    return notes


def print_notes(notes: Collection[str]) -> None:
    """One line each, from rank 0 only (every rank parses the flags before the process group exists)."""
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)


def unknown_flag_error(unknown: List[str], known: Collection[str]) -> str:
    """The one-line error for flags argparse did not recognise: a refusal reason for Megatron
    features we do not have, else the closest flag we accept."""
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(unknown)}"
    flag = flags[0]
    for prefix, reason in REFUSED_PREFIXES:
        if flag.startswith(prefix):
            return f"{flag} is a Megatron-LM flag this framework refuses: {reason}"
    close = difflib.get_close_matches(flag, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"unrecognized argument {flag}{hint} (docs/megatron_compatibility.md lists every flag we accept)")
