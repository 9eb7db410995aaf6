"""Process group, device and seeds: the start of every training process."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool = False
    """True when initialize_distributed created the group (and so pretrain() destroys it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def initialize_distributed(backend: str | None = None, timeout_minutes: int = 10) -> Runtime:
    """Join the torchrun job (RANK/WORLD_SIZE/MASTER_* in the environment) or start a
    one-process group, so the training code has a single path for one or many processes."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    created = not dist.is_initialized()
    if created:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:
            # A bound device makes new_group split NCCL communicators eagerly, which gloo cannot.
            dist.init_process_group(backend, timeout=timeout,
                                    device_id=device if device.type == "cuda" and "nccl" in backend else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, owns_process_group=created)


def set_deterministic_mode(enabled: bool) -> None:
    """--deterministic-mode: only deterministic kernels (an error names any op without one), and the
    cuBLAS workspace setting deterministic GEMMs need; bitwise-repeatable runs, at some speed."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def set_random_seeds(seed: int) -> None:
    """Python's, numpy's and torch's (every device's) generators from `seed`. build_trainer seeds the
    run's seed, the same on every rank, before building the model (identical initial weights, which
    DDP also broadcasts) and the pipeline stage's seed after it (dropout: tensor_parallel.stage_seed).
    Data order and the corruption have their own keyed randomness (datasets, diffusion.py)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
