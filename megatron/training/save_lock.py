"""One run at a time per --save directory.

Two runs saving into one directory would interleave their iterations and trackers into a mixed
checkpoint that still loads. A run therefore holds `DIR/.save.lock` (pid, host, start time),
created exclusively by rank 0 before anything is built. A second run stops with one line naming
the holder. A lock whose process is gone (same host, pid not alive: a SIGKILLed run) is stale
and taken over; one from another host is only named, since its process cannot be checked here.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.errors import InputError

LOCK_NAME = ".save.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class SaveLock:
    def __init__(self, path: str) -> None:
        self.path = path
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    def _create(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as handle:
            json.dump(self.owner, handle)
        return True

    def _holder(self) -> Optional[dict]:
        try:
            with open(self.path) as handle:
                return json.load(handle)
        except (OSError, ValueError):
            return None  # being written, or removed meanwhile: try again

    def acquire(self) -> None:
        for _ in range(3):
            if self._create():
                atexit.register(self.release)
                return
            holder = self._holder()
            if holder is None:
                time.sleep(0.05)
                continue
            if holder.get("host") == self.owner["host"] and not _alive(int(holder.get("pid", -1))):
                os.remove(self.path)  # stale: its run died without releasing it
                continue
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
            raise InputError(f"--save {os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid')} "
                             f"on {holder.get('host')}, since {since}); wait for it to end or choose another "
                             f"--save (if that run is gone, delete {self.path})")
        raise InputError(f"--save {os.path.dirname(self.path)}: could not take {self.path}; retry")

    def release(self) -> None:
        holder = self._holder()
        if holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def acquire_save_lock(root: str, device: torch.device) -> Optional[SaveLock]:
    """Collective: rank 0 takes the lock of `root`; every rank raises InputError if it could not."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, message = None, None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            lock = SaveLock(os.path.join(root, LOCK_NAME))
            lock.acquire()
        except (InputError, OSError) as error:
            lock, message = None, str(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([0.0 if message is None else 1.0], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and rank != 0:
            raise InputError(f"--save {root} could not be locked for this run (rank 0 says why)")
    if message is not None:
        raise InputError(message)
    return lock
