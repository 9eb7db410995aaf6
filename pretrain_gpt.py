"""Megatron-LM's entry-point name, for its launch scripts: autoregressive GPT pretraining.

This is `pretrain_difflm.py` with `--model-running-mode vanilla` (causal attention, next-token
loss) as the default, so a Megatron-LM script runs with only the script path changed; every
flag, including an explicit `--model-running-mode`, means what it means there.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 ... (Megatron-LM's flags)
"""

import sys
from typing import List, Optional

import pretrain_difflm


def with_ar_default(argv: List[str]) -> List[str]:
    if any(arg == "--model-running-mode" or arg.startswith("--model-running-mode=") for arg in argv):
        return list(argv)
    return ["--model-running-mode", "vanilla", *argv]


def main(argv: Optional[List[str]] = None):
    return pretrain_difflm.main(with_ar_default(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
