"""Hugging Face folders: sharded safetensors writing (with the index), lazy reading, config.json.

Reading checks the whole folder before any tensor is read: config.json parses, the index names
files that exist, and every safetensors header opens (safetensors checks that its data fills the
file, so a truncated download is found here). A bad folder raises `InputError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterator, List, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron.core.errors import InputError

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


_REFETCH = "the download or copy is incomplete or damaged: fetch or export the folder again"


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path} is not readable JSON ({error}); {_REFETCH}") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} is not a {what} (a JSON object); {_REFETCH}")
    return value


def read_config(folder: str) -> dict:
    """config.json of an HF folder (`--hf-path`)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        problem = "has no config.json" if os.path.isdir(folder) else "does not exist"
        raise InputError(f"--hf-path {folder} {problem}; point it at a Hugging Face model folder "
                         "(config.json + safetensors weights)")
    return _read_json(path, "model config")


def _open(path: str):
    if not os.path.isfile(path):
        raise InputError(f"{path} is missing although {INDEX_FILE} names it; {_REFETCH}")
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise InputError(f"{path} is not a readable safetensors file ({error}); {_REFETCH}") from None


class LazyWeights:
    """The tensors of an HF folder (model.safetensors or sharded with an index), read one at a time."""

    def __init__(self, folder: str) -> None:
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            weight_map = _read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{index} has no weight_map; {_REFETCH}")
            self.location = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            path = os.path.join(folder, SINGLE_FILE)
            self.location = {name: path for name in _open(path).keys()}
        else:
            raise InputError(f"--hf-path {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: only safetensors "
                             "weights are read (save with safe_serialization=True)")
        # Every header now, so a truncated shard is an error before any conversion work.
        self._handles = {path: _open(path) for path in sorted(set(self.location.values()))}

    def names(self) -> Iterator[str]:
        return iter(self.location)

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise KeyError(f"the Hugging Face checkpoint has no tensor {name}")
        path = self.location[name]
        try:
            return self._handles[path].get_tensor(name)
        except SafetensorError as error:  # e.g. an index naming a tensor its shard does not hold
            raise InputError(f"{path}: tensor {name} is not readable ({error}); {_REFETCH}") from None
