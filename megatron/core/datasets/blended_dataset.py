"""BlendedDataset: a deterministic weighted mixture of datasets.

Sample t of the blend comes from the dataset with the largest sampling deficit
`w_i * max(t, 1) - drawn_i` (ties to the lowest index), Megatron's rule: no RNG, the mix
tracks the weights as closely as integer counts allow at every prefix of the stream, and the
randomness comes from each component's own shuffle.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


def blend_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) by the largest-deficit rule."""
    weights = [float(w) for w in weights]
    total = sum(weights)
    weights = [w / total for w in weights]
    drawn = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    candidates = range(len(weights))
    # A plain loop: the rule is sequential. About a second per few million samples; cached.
    for t in range(size):
        scale = max(t, 1)
        chosen = max(candidates, key=lambda i: (weights[i] * scale - drawn[i], -i))
        dataset_index[t] = chosen
        sample_index[t] = drawn[chosen]
        drawn[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    def __init__(self, datasets: List[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 cache_dir: Optional[str] = None, barrier: Optional[Callable[[], None]] = None,
                 is_builder: bool = True) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        key_source = json.dumps({"class": "BlendedDataset", "weights": self.weights, "size": size,
                                 "datasets": [getattr(d, "unique_key", repr(d)) for d in datasets]})
        self.unique_key = hashlib.sha256(key_source.encode()).hexdigest()[:32]
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir, barrier, is_builder)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for i, (count, dataset) in enumerate(zip(counts, datasets)):
            if count > len(dataset):
                raise ValueError(f"blended dataset {i} is asked for {count} samples but holds {len(dataset)}")

    def _load_or_build(self, cache_dir, barrier, is_builder):
        if cache_dir is None:
            return blend_indices(self.weights, self.size)
        stem = os.path.join(cache_dir, f"{self.unique_key}-BlendedDataset")
        paths = (f"{stem}-dataset_index.npy", f"{stem}-dataset_sample_index.npy")
        if is_builder and not all(os.path.exists(p) for p in paths):
            os.makedirs(cache_dir, exist_ok=True)
            for path, array in zip(paths, blend_indices(self.weights, self.size)):
                np.save(path + ".tmp.npy", array)
                os.replace(path + ".tmp.npy", path)
        if barrier is not None:
            barrier()
        return tuple(np.load(p, mmap_mode="r") for p in paths)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        dataset = self.datasets[int(self.dataset_index[index])]
        sample = dict(dataset[int(self.dataset_sample_index[index])])
        sample["index"] = torch.tensor(index, dtype=torch.int64)  # the stream position keys the corruption
        return sample
