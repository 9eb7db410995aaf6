"""Every RNG state of a rank, as tensors: python's, numpy's, torch's (CPU and CUDA) and the
model's tensor-parallel streams.

Three places need the same capture: a checkpoint (`rng/rank_N.pt`, loaded with weights_only, so
only tensors), the rerun of a step (rerun.py: dropout must draw again what it drew) and the
in-loop evaluation (in_loop.py: lm-eval reseeds every generator, and training must go on as if it
had not run).
"""

from __future__ import annotations

import random
from typing import Dict

import numpy as np
import torch

from megatron.core.distributed.data_parallel import unwrap

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state(model) -> Dict[str, torch.Tensor]:
    """This rank's generators now (`model`: the one whose `rng_tracker` streams are included)."""
    python_version, python_words, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {"torch_cpu": torch.get_rng_state(),
             "python": torch.tensor(list(python_words), dtype=torch.int64),
             "python_meta": torch.tensor([python_version, python_gauss is not None], dtype=torch.int64),
             "python_gauss": torch.tensor([python_gauss or 0.0], dtype=torch.float64),
             "numpy_keys": torch.from_numpy(numpy_keys.astype(np.int64)),
             "numpy_meta": torch.tensor([numpy_pos, numpy_has_gauss], dtype=torch.int64),
             "numpy_gauss": torch.tensor([numpy_gauss], dtype=torch.float64)}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    tracker = getattr(unwrap(model), "rng_tracker", None)
    if tracker is not None:
        for name, per_device in tracker.get_states().items():
            for device, tensor in per_device.items():
                state[f"tracker/{name}/{device}"] = tensor
    return state


def restore_rng_state(model, state: Dict[str, torch.Tensor]) -> None:
    """Put back what `capture_rng_state` returned."""
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    version, has_gauss = (int(v) for v in state["python_meta"])
    gauss = float(state["python_gauss"][0]) if has_gauss else None
    random.setstate((version, tuple(int(v) for v in state["python"]), gauss))
    position, numpy_has_gauss = (int(v) for v in state["numpy_meta"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), position, numpy_has_gauss,
                         float(state["numpy_gauss"][0])))
    tracker = getattr(unwrap(model), "rng_tracker", None)
    if tracker is not None:
        streams: Dict[str, Dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            if key.startswith("tracker/"):
                _, name, device = key.split("/")
                streams.setdefault(name, {})[device] = tensor
        tracker.set_states(streams)
