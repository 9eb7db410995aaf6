"""Read files written by torch.save (Megatron-LM's `common.pt` and its legacy per-rank
`model_optim_rng.pt`) without executing code from them.

torch's weights-only unpickler admits tensors and plain builtins; these files also hold an
argparse Namespace (the run's args), members of Megatron-LM's own enums in it (`model_type`,
`attention_backend`) and of signal.Signals (`exit_signal`), and, in the legacy format's RNG states,
numpy arrays. The Namespace is admitted as it is; the classes of FOREIGN_MODULES the pickle names (read
from its GLOBAL opcodes first) are admitted as inert stand-ins that only record what they were built
from, so neither Megatron's nor numpy's code is imported or run. Any other class is an InputError
naming the file.
"""

from __future__ import annotations

import argparse
import pickle
import pickletools
import zipfile
from typing import List

import torch

from megatron.core.errors import InputError

__all__ = ["FOREIGN_MODULES", "ForeignObject", "foreign_globals", "safe_torch_load"]

# Modules whose classes a Megatron-LM checkpoint's pickle names, read as inert stand-ins (ForeignObject): its own,
# numpy's, and `signal` (Megatron-LM's args hold the member of signal.Signals that --exit-signal names)
FOREIGN_MODULES = ("megatron", "megatron_core", "numpy", "signal")


class ForeignObject:
    """An object of a class the reader never imports, from a checkpoint's pickle: Megatron-LM's own (its args
    hold enum members: `model_type`, `attention_backend`) or numpy's (the legacy format's RNG states). Kept
    inert: the class's name and what it was built from; a subclass per class name stands in for it."""

    name = "?"

    def __init__(self, *args) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{self.name}{self.args}"


def foreign_globals(path: str) -> List[str]:
    """The classes of FOREIGN_MODULES a torch.save file's pickle names (GLOBAL opcodes; nothing is loaded)."""
    with zipfile.ZipFile(path) as archive:
        pickled = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        data = archive.read(pickled[0]) if pickled else b""
    names = set()
    for opcode, argument, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL" and str(argument).split(" ")[0].split(".")[0] in FOREIGN_MODULES:
            names.add(str(argument).replace(" ", "."))
    return sorted(names)


def safe_torch_load(path: str):
    """torch.load with weights-only unpickling: tensors, builtins, argparse.Namespace, and FOREIGN_MODULES'
    classes as inert ForeignObject stand-ins; anything else is InputError, and no code from the file runs.
    Memory-mapped: a rank reads the pages of the tensors it copies."""
    try:
        stand_ins = [(type(name, (ForeignObject,), {"name": name}), name) for name in foreign_globals(path)]
        with torch.serialization.safe_globals([argparse.Namespace, *stand_ins]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise InputError(f"{path}: cannot be read safely ({_reason(error)}); load a checkpoint you trust") from None


def _reason(error: BaseException) -> str:
    """The line of torch's error that names what was refused (its first lines are general advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "Unsupported operand" in line]
    reason = named[0] if named else (lines[0] if lines else type(error).__name__)
    return reason.split(" was not an allowed global")[0].replace("WeightsUnpickler error: ", "")
