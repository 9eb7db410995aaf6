"""lm-evaluation-harness's own command line with our model ``megadlms`` registered.

    python tools/lm_eval_harness.py --model megadlms --model_args load=CKPT_DIR,mc_num=128,batch_size=32 \
        --tasks arc_easy [--include_path DIR_OF_TASK_YAMLS] [--limit N] [--output_path OUT]
    python tools/lm_eval_harness.py --model megadlms --model_args pretrained=HF_DIR,cfg=0.5 --tasks piqa
    torchrun --nproc-per-node 8 tools/lm_eval_harness.py --model megadlms --model_args load=CKPT_DIR ...

Every flag is lm-eval's (``--help`` lists them); megatron/evaluation/lm_eval_adapter.py lists
the model_args. Under torchrun each rank evaluates its share of the requests (the adapter joins
the process group the environment describes, NCCL on GPUs, gloo on CPU). Needs
``pip install -e .[dev]`` (lm-eval 0.4.x).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _join_process_group() -> None:
    """torchrun sets WORLD_SIZE > 1: start the process group the adapter's gathers use."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)


def main(argv: Optional[List[str]] = None) -> None:
    """Run lm-eval's CLI on `argv` (default: this process's arguments) with megadlms registered."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("error: lm-eval is not installed; pip install -e '.[dev]' (or 'lm-eval>=0.4.5,<0.5')", file=sys.stderr)
        sys.exit(2)
    import megatron.evaluation.lm_eval_adapter  # noqa: F401 (registers the model "megadlms")

    if argv is not None:  # lm-eval's CLI reads sys.argv itself
        sys.argv = [sys.argv[0], *argv]
    _join_process_group()
    cli_evaluate()


if __name__ == "__main__":
    main()
