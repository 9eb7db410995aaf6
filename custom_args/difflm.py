"""Command-line flags of the diffusion objective (argument group "difflm").

Passed to `pretrain(..., extra_args_provider=add_difflm_args)` by pretrain_difflm.py; they
build `megatron.core.transformer.transformer_config.DLMConfig`.
"""

import argparse

from megatron.core.transformer.transformer_config import (ATTENTION_MASK_TYPES, LOSS_NORMALIZERS, LOSS_WEIGHTS,
                                                          MASK_TYPE_ALIASES, RUNNING_MODES, T_DISTRIBUTIONS,
                                                          T_SAMPLINGS)


def block_size_schedule(text: str) -> tuple:
    """`0:1,2000:4` -> ((0, 1), (2000, 4)) (argparse type of --difflm-block-size-schedule)."""
    try:
        entries = tuple(tuple(int(part) for part in entry.split(":")) for entry in text.split(","))
    except ValueError:
        entries = ()
    if not entries or any(len(entry) != 2 for entry in entries):
        raise argparse.ArgumentTypeError(f"{text!r} is not ITER:SIZE pairs separated by commas (e.g. 0:1,2000:4)")
    return entries


def add_difflm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("difflm", "masked-diffusion objective")
    _add_mode_args(g)
    _add_corruption_args(g)
    _add_loss_args(g)
    return parser


def _add_mode_args(g) -> None:
    """What the model computes: the running mode, its attention, the mask token, block diffusion."""
    g.add_argument("--model-running-mode", default="difflm-noshift", choices=RUNNING_MODES,
                   help="difflm-noshift: position i predicts token i; difflm-shift: i predicts i+1 "
                        "(AR-initialised); vanilla: autoregressive.")
    g.add_argument("--attention-mask-type", default="no_mask",
                   choices=list(ATTENTION_MASK_TYPES) + list(MASK_TYPE_ALIASES),
                   help="Attention in the DLM modes (vanilla: causal, or a causal sliding_window). "
                        "causal_bottom_right = causal; sliding_window (= sliding_window_causal) sees the "
                        "--sliding-window keys up to the query, sliding_window_two_sided (DLMs) those within that "
                        "distance on both sides.")
    g.add_argument("--mask-token", type=int, help="Id of the mask token (default: the tokenizer's).")
    g.add_argument("--difflm-block-size", type=int,
                   help="Block length of block_causal attention and of --difflm-block-diffusion.")
    g.add_argument("--difflm-block-size-schedule", type=block_size_schedule, metavar="ITER:SIZE,...",
                   help="A block-size curriculum: from each 0-based iteration on, the block size after it (e.g. "
                        "0:1,2000:4,4000:32,8000:4096,40000:32, LLaDA 2.0's warmup-stable-decay shape; a size equal "
                        "to --seq-length is one block, plain MDLM). Starts at 0; each size divides --seq-length. "
                        "The log line and tensorboard show the current size; a checkpoint records the size it ends "
                        "at, which sampling and the Hugging Face export use.")
    g.add_argument("--difflm-block-diffusion", action="store_true",
                   help="BD3-LM block diffusion: the model reads [x_t ; x_0] under one mask (each noisy block sees "
                        "itself and the clean blocks before it), t is drawn per block, the loss is on x_t; sampling "
                        "goes block by block with an exact KV cache. Needs --difflm-block-size.")
    g.add_argument("--difflm-ar-loss-weight", type=float, default=0.0, metavar="W",
                   help="Joint AR + DLM objective: add W times the next-token loss of the clean tokens to the "
                        "diffusion loss (Megatron-Bridge's Nemotron Diffusion weighs DLM 0.3 and AR 1.0, i.e. "
                        "W = 3.33 up to the learning rate). Rides on --difflm-block-diffusion's clean half, which "
                        "becomes token-causal: no second forward, the model decodes both autoregressively and by "
                        "diffusion. Each term is logged. Needs --difflm-loss-normalizer tokens or sequence.")
    g.add_argument("--difflm-confidence-loss-weight", type=float, default=0.0, metavar="LAMBDA",
                   help="LLaDA 2.0's confidence-aware (CAP) training: add LAMBDA times the entropy of the predicted "
                        "distribution at the masked positions whose argmax is already right, so threshold decoding "
                        "commits more tokens per step. Logged as its own term; not part of the ELBO. Needs the "
                        "full-logits loss (not --difflm-masked-only-loss).")
    g.add_argument("--difflm-ignore-bos", action="store_true",
                   help="Never mask the first token of a row (BD3-LM's ignore_bos): always clean, no loss.")


def _add_corruption_args(g) -> None:
    """How a clean batch is corrupted: the noise level t, its range and sampling, cut lengths."""
    g.add_argument("--difflm-eps", type=float, default=1e-3, help="Lowest mask probability: p = (1-eps)t + eps.")
    g.add_argument("--difflm-t-sampling", default="uniform", choices=T_SAMPLINGS,
                   help="t per sequence: uniform, or antithetic (stratified over the global batch).")
    g.add_argument("--difflm-t-min", type=float, default=0.0,
                   help="Noise levels t are drawn in [t-min, t-max) (dFactory's SFT: 0.3 to 0.8; BD3-LM's clipped "
                        "schedule, whose 1/p weight becomes 1 under --difflm-block-diffusion when t-min > 0.5).")
    g.add_argument("--difflm-t-max", type=float, default=1.0, help="See --difflm-t-min.")
    g.add_argument("--difflm-t-distribution", default="uniform", choices=T_DISTRIBUTIONS,
                   help="How t is distributed over [t-min, t-max): uniform (MDLM, LLaDA), logit_normal, or beta (a "
                        "bell for a, b > 1), mixed with --difflm-t-uniform-mix of uniform t. A non-uniform t's loss "
                        "is importance-weighted by 1/q(t), so it stays an unbiased ELBO estimate over uniform t; see "
                        "--difflm-t-no-importance-weight.")
    g.add_argument("--difflm-t-logit-normal-mean", type=float, default=0.0,
                   help="logit_normal: the mean of logit(t) (0: centred on the middle of the range).")
    g.add_argument("--difflm-t-logit-normal-std", type=float, default=1.0,
                   help="logit_normal: the standard deviation of logit(t).")
    g.add_argument("--difflm-t-beta", type=float, nargs=2, default=[2.0, 2.0], metavar=("A", "B"),
                   help="beta: its parameters a and b, each >= 1 (2 2: a symmetric bell).")
    g.add_argument("--difflm-t-uniform-mix", type=float, default=0.1,
                   help="Share of uniform t mixed into a non-uniform one: the importance weight 1/q(t) stays at "
                        "most 1/mix (0: the pure shape, whose weights have unbounded variance).")
    g.add_argument("--difflm-t-no-importance-weight", dest="difflm_t_importance_weight", action="store_false",
                   help="Train a non-uniform t without the 1/q(t) weight: a biased surrogate of the ELBO that spends "
                        "the training signal near q's mode (as logit-normal timesteps do in rectified flows); the "
                        "logged loss is then not an ELBO estimate.")
    g.add_argument("--difflm-varilen-prob", type=float, default=0.0,
                   help="Probability that a training micro-batch is cut to a random length (LLaDA: 0.01).")
    g.add_argument("--difflm-varilen-multiple", type=int, default=8,
                   help="Cut lengths are multiples of this (and of --difflm-block-size with block_causal). It "
                        "does not depend on the layout, so every layout cuts alike; with --sequence-parallel the "
                        "tensor-parallel size must divide it.")
    g.add_argument("--difflm-per-document-t", action="store_true",
                   help="With --reset-attention-mask, draw t per packed document.")


def _add_loss_args(g) -> None:
    """The loss: token weights and normalizer, the masked-only chunked output layer and its kernel,
    validation's corruption draws."""
    g.add_argument("--difflm-loss-weight", default="inverse_p", choices=LOSS_WEIGHTS,
                   help="Weight of masked tokens: 1/p (LLaDA), 1/realised fraction (MegaDLMs) or none.")
    g.add_argument("--difflm-loss-normalizer", default="tokens", choices=LOSS_NORMALIZERS,
                   help="Divide by valid tokens (B*L, LLaDA), masked tokens, or per sequence.")
    g.add_argument("--difflm-masked-only-loss", action="store_true",
                   help="Output layer and cross-entropy only at positions with a loss weight (the masked "
                        "tokens), in chunks: no full fp32 logits. Same loss and gradients; one host sync "
                        "per micro-batch.")
    g.add_argument("--difflm-loss-chunk-size", type=int, default=4096,
                   help="Tokens per chunk of --difflm-masked-only-loss (memory ~ 8 bytes x chunk x vocab / tp).")
    g.add_argument("--difflm-compile-loss", action="store_true",
                   help="With --difflm-masked-only-loss: each chunk's softmax, loss and logits gradient fused, "
                        "on CUDA as a Triton kernel (0.93 ms a 4,096-token chunk at Qwen3-1.7B on an H200, against "
                        "a dozen eager passes; docs/performance_history.md), elsewhere torch.compile's; under tensor "
                        "parallelism two Triton kernels with one all-gather between (eager passes without Triton).")
    g.add_argument("--difflm-loss-kernel", choices=["triton", "inductor"], default="triton",
                   help="With --difflm-compile-loss, where Triton runs: the hand-written Triton kernel (triton) or "
                        "torch.compile's kernel of the same function (inductor; under tensor parallelism the eager "
                        "passes). Same values up to rounding; tools/benchmark/train_throughput.py --loss-kernel "
                        "times one against the other.")
    g.add_argument("--difflm-eval-mc-samples", type=int, default=1,
                   help="Corruption draws per validation row (K): each draw is fixed across evaluations and "
                        "independent of the others; the logged validation loss is the K draws' summed token "
                        "losses over their summed normalizers (with --difflm-loss-normalizer tokens: the mean of "
                        "the K single-draw losses). 1: today's single draw. Vanilla mode: ignored (exact loss).")
