"""Hugging Face weight files: sharded safetensors writing (with the index) and lazy reading."""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterator, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


class ShardedWriter:
    """Collects tensors in order and writes a shard whenever the next tensor would exceed the size.

    Shards are written as they fill (memory holds one shard) and renamed at the end to
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, or to
    `model.safetensors` when everything fit in one.
    """

    def __init__(self, output_dir: str, max_shard_bytes: int, metadata: Optional[Dict[str, str]] = None) -> None:
        self.output_dir, self.max_shard_bytes = output_dir, max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[List[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _temporary(self, index: int) -> str:
        return os.path.join(self.output_dir, f".shard-{index:05d}.safetensors.tmp")

    def _flush(self) -> None:
        save_file(self.pending, self._temporary(len(self.shards)), metadata=self.metadata)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> List[str]:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self._temporary(0), os.path.join(self.output_dir, SINGLE_FILE))
            return [SINGLE_FILE]
        names, weight_map = [], {}
        for index, tensors in enumerate(self.shards):
            name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._temporary(index), os.path.join(self.output_dir, name))
            names.append(name)
            weight_map.update({tensor: name for tensor in tensors})
        with open(os.path.join(self.output_dir, INDEX_FILE), "w") as handle:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, handle, indent=2)
        return names


class LazyWeights:
    """The tensors of an HF folder (model.safetensors or sharded with an index), read one at a time."""

    def __init__(self, folder: str) -> None:
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            self.location = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            path = os.path.join(folder, SINGLE_FILE)
            with safe_open(path, framework="pt") as handle:
                self.location = {name: path for name in handle.keys()}
        else:
            raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: only safetensors "
                                    "weights are read (save with safe_serialization=True)")
        self._handles = {}

    def names(self) -> Iterator[str]:
        return iter(self.location)

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise KeyError(f"the Hugging Face checkpoint has no tensor {name}")
        path = self.location[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(name)
