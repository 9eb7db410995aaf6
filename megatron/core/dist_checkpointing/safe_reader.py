"""Read DCP checkpoints without executing code from them.

torch.distributed.checkpoint stores its index (`.metadata`) as a pickle and reads it with a
plain `pickle.load`, so a crafted checkpoint runs arbitrary code on load. `SafeFileSystemReader`
reads the same file with an unpickler that resolves only the classes DCP's index is made of
(its metadata dataclasses, torch.Size, dtypes, layouts, paths, a few builtins); anything
else is refused with a `CheckpointMetadataError` naming the file and the class.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.errors import InputError

# (module, name) pairs the index may reference, beyond the dtypes and DCP's metadata module.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class CheckpointMetadataError(InputError):
    pass


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (module == _METADATA_MODULE and not name.startswith("__")):
            return super().find_class(module, name)
        raise CheckpointMetadataError(
            f"{self.path} references {module}.{name}, which a checkpoint index never holds: refusing to "
            "unpickle it (the file is damaged or crafted); load a checkpoint you trust")


def read_index(path: str) -> Any:
    """Unpickle a DCP `.metadata` file through the allow-list."""
    with open(path, "rb") as handle:
        try:
            return _AllowListUnpickler(handle, path).load()
        except CheckpointMetadataError:
            raise
        except Exception as error:  # truncated or not a pickle at all
            raise CheckpointMetadataError(f"{path} is not a readable checkpoint index ({type(error).__name__}: "
                                          f"{error}); the save was interrupted or the file is damaged") from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with the index read through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        metadata = read_index(os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
