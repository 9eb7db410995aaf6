"""Read DCP checkpoints without executing code from them.

torch.distributed.checkpoint stores its index (`.metadata`) as a pickle and reads it with a
plain `pickle.load`, so a crafted checkpoint runs arbitrary code on load. `SafeFileSystemReader`
reads the same file with an unpickler that resolves only the classes DCP's index is made of
(its metadata dataclasses, torch.Size, dtypes, layouts, paths, a few builtins); anything
else is refused with a `CheckpointMetadataError` naming the file and the class.

A shard file that is missing, shorter than the index says (`check_shard_files`, before anything
is read) or unreadable (DCP's own error does not say which file: the reader reads one file at a
time to know) raises a `DamagedCheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any, Dict

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
# megatron-core's saves also keep their save plans in the index: plain dataclasses of DCP's planner
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"


class CheckpointMetadataError(InputError):
    pass


class DamagedCheckpointError(InputError):
    """A shard file that is missing, cut short or unreadable: names the file, says the checkpoint is
    damaged, and gives `fix` (the caller knows which iterations could be loaded instead)."""

    def __init__(self, path: str, problem: str, fix: str = "load an earlier iteration") -> None:
        super().__init__(path, problem, fix)  # the arguments rebuild it when DCP sends it between ranks
        self.path, self.problem, self.fix = path, problem, fix

    def __str__(self) -> str:
        return f"{self.path} {self.problem}: the checkpoint is damaged (an interrupted save or copy); {self.fix}"

    def with_fix(self, fix: str) -> "DamagedCheckpointError":
        return DamagedCheckpointError(self.path, self.problem, fix)


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (module in (_METADATA_MODULE, _PLANNER_MODULE) and not name.startswith("__")):
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

    def read_data(self, plan, planner):
        """DCP's read, one shard file at a time: a file that cannot be read is named."""
        by_file: Dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        done = None
        for relative_path, items in by_file.items():
            try:
                done = super().read_data(dataclasses.replace(plan, items=items), planner)
                done.wait()
            except Exception as error:  # a damaged pickle, a short read, a size that does not match
                detail = type(error).__name__
                if not isinstance(error, pickle.UnpicklingError):  # whose text suggests unsafe loading instead
                    detail += ": " + (str(error).strip().splitlines() or [""])[0][:160]
                raise DamagedCheckpointError(os.path.join(str(self.path), relative_path),
                                             f"cannot be read ({detail})") from None
        return done if done is not None else super().read_data(plan, planner)


def check_shard_files(checkpoint_dir: str) -> None:
    """Every shard file the index names is there and as long as the index says (a DamagedCheckpointError
    otherwise); reads the index and the files' sizes only. Damage inside a file of the right size is
    found when it is read (SafeFileSystemReader.read_data)."""
    needed: Dict[str, int] = {}
    index = read_index(os.path.join(checkpoint_dir, ".metadata"))
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(checkpoint_dir, name)
        actual = os.path.getsize(path) if os.path.isfile(path) else None
        if actual is None or actual < size:
            raise DamagedCheckpointError(path, "is missing" if actual is None else
                                         f"is {actual} bytes where the index expects {size}")
