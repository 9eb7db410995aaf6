"""Megatron-LM's entry-point name, for its launch scripts: autoregressive GPT pretraining.

This is `pretrain_difflm.py` with `--model-running-mode vanilla` (causal attention, next-token
loss) as the default, so a Megatron-LM script runs with only the script path changed; every
flag, including an explicit `--model-running-mode`, means what it means there.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 ... (Megatron-LM's flags)
"""

import sys
from typing import List, Optional

import pretrain_difflm
from megatron.training.compat_args import print_notes

# Megatron-LM's default position encoding is a learned table, which is not implemented here.
POSITION_NOTE = ("no --position-embedding-type given: positions are RoPE here (Megatron-LM's default, "
                 "learned_absolute, is not implemented); docs/megatron_compatibility.md")


def _gives(argv: List[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in argv)


def with_ar_default(argv: List[str]) -> List[str]:
    if _gives(argv, "--model-running-mode"):
        return list(argv)
    return ["--model-running-mode", "vanilla", *argv]


def main(argv: Optional[List[str]] = None):
    argv = sys.argv[1:] if argv is None else argv
    if not _gives(argv, "--position-embedding-type"):
        print_notes([POSITION_NOTE])
    return pretrain_difflm.main(with_ar_default(argv))


if __name__ == "__main__":
    main()
