"""Supervised fine-tuning flags (`--sft`, Megatron-LM's spelling) and their rules.

With `--sft` the data are chat examples from `tools/preprocess_data.py --chat` (or synthetic ones
with --mock-data): the prompt is never masked and carries no loss, the answer is the target
(megatron/core/datasets/sft_dataset.py reads them; pretrain_difflm.get_batch turns the answer
flags into the loss mask). Start from a checkpoint or an HF import with `--load DIR --finetune`.

`--sft-normalizer` picks a published recipe for the DLM loss, as three existing knobs:

| recipe   | weight of a masked token | divided by                                      | t         |
|----------|--------------------------|-------------------------------------------------|-----------|
| llada    | 1/p                      | each row's answer length, then rows (mean)      | U(0, 1)   |
| dllm     | 1/p                      | answer tokens of the batch                      | U(0, 1)   |
| dfactory | 1 (none)                 | masked tokens of the batch                      | U(0.3, 0.8) |

Without it the --difflm-loss-* flags decide (their defaults are the dllm recipe). AR fine-tuning
(--model-running-mode vanilla) predicts the answer tokens only, divided by their number.
"""

from __future__ import annotations

import argparse
from typing import Collection, List

from megatron.core.datasets.sft_dataset import SFT_PADDINGS

SFT_RECIPES = {
    # recipe: (--difflm-loss-weight, --difflm-loss-normalizer, --difflm-t-min, --difflm-t-max)
    "llada": ("inverse_p", "sequence", 0.0, 1.0),
    "dllm": ("inverse_p", "tokens", 0.0, 1.0),
    "dfactory": ("none", "masked", 0.3, 0.8),
}
RECIPE_DESTS = ("difflm_loss_weight", "difflm_loss_normalizer", "difflm_t_min", "difflm_t_max")

SFT_FLAG_NEEDS = (
    ("sft_padding", "--sft", lambda a: a.sft),
    ("sft_normalizer", "--sft", lambda a: a.sft),
)


def add_sft_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("supervised fine-tuning")
    g.add_argument("--sft", action="store_true",
                   help="Fine-tune on chat examples (tools/preprocess_data.py --chat): prompt tokens are never masked "
                        "and carry no loss. Combine with --load DIR --finetune.")
    g.add_argument("--sft-padding", default="eos", choices=SFT_PADDINGS,
                   help="eos: one example per row, right-padded with EOD that is trained as answer (LLaDA); pack: "
                        "examples packed into rows with attention inside each example.")
    g.add_argument("--sft-normalizer", choices=sorted(SFT_RECIPES),
                   help="DLM loss recipe: llada (1/p, per-row answer length), dllm (1/p, answer tokens), dfactory "
                        "(t ~ U(0.3, 0.8), no weight, masked tokens). Default: the --difflm-loss-* flags.")


def validate_sft_args(args: argparse.Namespace, given: Collection[str]) -> List[str]:
    """Apply --sft-normalizer's recipe; ValueError (one line) for a flag combination SFT cannot honour."""
    if not args.sft:
        return []
    for dest in ("reset_attention_mask", "reset_position_ids"):
        if getattr(args, dest):
            raise ValueError(f"--{dest.replace('_', '-')} finds documents at EOD, which an SFT answer also "
                             "contains; with --sft use --sft-padding pack (attention inside each example) instead")
    notes = []
    diffusion = getattr(args, "model_running_mode", "vanilla") != "vanilla"
    if args.sft_normalizer and not diffusion:
        notes.append(f"--sft-normalizer {args.sft_normalizer} has no effect with --model-running-mode vanilla (the "
                     "AR loss is the mean over answer tokens); ignored")
    elif args.sft_normalizer:
        clashing = [dest for dest in RECIPE_DESTS if dest in given]
        if clashing:
            raise ValueError(f"--sft-normalizer {args.sft_normalizer} sets the loss recipe, and "
                             f"--{clashing[0].replace('_', '-')} sets part of it too; give one of them")
        for dest, value in zip(RECIPE_DESTS, SFT_RECIPES[args.sft_normalizer]):
            setattr(args, dest, value)
    return notes
