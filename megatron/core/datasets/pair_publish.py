"""Replacing `.bin`/`.idx` pairs so that a crash at any moment leaves a readable corpus.

Two files cannot be renamed in one step, so `publish_pairs` keeps the earlier files as hard
links (`X.bin.prev`, `X.idx.prev`) until the new ones are all in place:

1. every existing output is linked to its `.prev` name (no data is copied);
2. every new `.bin` is renamed onto its name, then every new `.idx`, the corpus's token `.idx`
   last: that rename is the commit;
3. the `.prev` links are removed.

A reader (`readable_pair`) that finds the token `.idx` still the same file as its `.prev` knows
the publish did not commit and reads the earlier files, answer pairs included; otherwise it
reads the current names. A later publish first undoes an uncommitted one. Where hard links
are not supported the earlier pair is replaced without a backup (the window of two renames).
The first pair of `pairs` is the token pair; the others (an SFT answer pair) follow its commit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Tuple

PREVIOUS = ".prev"
EXTENSIONS = (".bin", ".idx")


def _same(path: str, other: str) -> bool:
    try:
        return os.path.samefile(path, other)
    except OSError:  # either file missing
        return False


def uncommitted(token_prefix: str) -> bool:
    """True while (or after a crash during) a publish that has not renamed the token .idx yet."""
    idx = token_prefix + ".idx"
    return _same(idx, idx + PREVIOUS)


def readable_pair(prefix: str, token_prefix: Optional[str] = None) -> Tuple[str, str]:
    """(.idx, .bin) to read for `prefix`: the earlier files while its corpus's publish is
    uncommitted (`token_prefix`: the corpus an answer pair belongs to; default `prefix`)."""
    if uncommitted(token_prefix or prefix):
        return prefix + ".idx" + PREVIOUS, prefix + ".bin" + PREVIOUS
    return prefix + ".idx", prefix + ".bin"


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _undo_uncommitted(prefixes: List[str]) -> None:
    """Put the earlier files back after a publish that crashed before its commit."""
    for prefix in prefixes:
        for extension in EXTENSIONS:
            final = prefix + extension
            if os.path.lexists(final + PREVIOUS):
                os.replace(final + PREVIOUS, final)
            else:  # did not exist before that publish: its new half goes
                _remove(final)


def _link_previous(final: str) -> None:
    """Hard-link an existing output to its .prev name (nothing where links are not supported)."""
    _remove(final + PREVIOUS)
    if os.path.exists(final):
        with contextlib.suppress(OSError):
            os.link(final, final + PREVIOUS)


def publish_pairs(pairs: Dict[str, Tuple[Optional[str], Optional[str]]]) -> None:
    """Rename complete staged files onto `prefix.bin` / `prefix.idx` for every prefix of `pairs`
    (prefix -> (staged .bin, staged .idx); (None, None) removes an output that this run does
    not write, as a stale answer pair). The first prefix is the token pair, committed last."""
    prefixes = list(pairs)
    if uncommitted(prefixes[0]):
        _undo_uncommitted(prefixes)
    finals = [prefix + extension for prefix in prefixes for extension in EXTENSIONS]
    for final in finals:
        _link_previous(final)
    for position in (0, 1):  # every .bin, then every .idx; the token pair's .idx last
        for prefix in prefixes[1:] + prefixes[:1]:
            staged, final = pairs[prefix][position], prefix + EXTENSIONS[position]
            if staged is None:
                _remove(final)
            else:
                os.replace(staged, final)
    fsync_path(os.path.dirname(os.path.abspath(prefixes[0])))
    for final in finals:
        _remove(final + PREVIOUS)


def fsync_path(path: str) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename never exposes empty data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
