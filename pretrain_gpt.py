"""Megatron-LM's entry-point name, for its launch scripts: autoregressive GPT pretraining.

This is `pretrain_difflm.py` with Megatron-LM's GPT defaults: `--model-running-mode vanilla` (causal
attention, next-token loss) and `--position-embedding-type learned_absolute` (a learned position
table; pretrain_difflm.py's default is RoPE), so a Megatron-LM script runs with only the script path
changed; every flag, these two included, means what it means there.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 ... (Megatron-LM's flags)
"""

import sys
from typing import List, Optional

import pretrain_difflm

# Megatron-LM's defaults that differ from pretrain_difflm.py's.
GPT_DEFAULTS = {"--model-running-mode": "vanilla", "--position-embedding-type": "learned_absolute"}


def _gives(argv: List[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in argv)


def with_gpt_defaults(argv: List[str]) -> List[str]:
    """`argv` with Megatron-LM's GPT defaults for the flags it leaves out (--use-checkpoint-args still takes
    a checkpoint's own position encoding)."""
    defaults = [item for flag, value in GPT_DEFAULTS.items() if not _gives(argv, flag) for item in (flag, value)]
    return [*defaults, *argv]


def main(argv: Optional[List[str]] = None):
    argv = sys.argv[1:] if argv is None else argv
    return pretrain_difflm.main(with_gpt_defaults(argv))


if __name__ == "__main__":
    main()
